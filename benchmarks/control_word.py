"""Cost of the per-step control word at 2 ranks, as a fraction of a training step.

Launches itself under torchrun (2 ranks, gloo, CPU, one thread each). Each rank times the
control-word exchange (one 3-float MAX all-reduce on its own gloo group) and a forward+backward
step of the debug model on its own batch, measured in the same run::

    python benchmarks/control_word.py [--exchanges 500]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from forge.cli import summary
from forge.config import ModelConfig
from forge.model.transformer import Transformer
from forge.resilience.control import ControlChannel
from forge.types import Signals


def worker(exchanges: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    channel = ControlChannel(dist.get_world_size(), timeout_s=60)
    for _ in range(20):  # warm-up
        channel.exchange(Signals())
    times = []
    for _ in range(exchanges):
        start = time.perf_counter()
        channel.exchange(Signals())
        times.append(time.perf_counter() - start)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256))
    tokens = torch.randint(0, 259, (4, 256))
    steps = []
    for _ in range(4):
        start = time.perf_counter()
        model(tokens).float().mean().backward()
        steps.append(time.perf_counter() - start)
    word, step = statistics.median(times), statistics.median(steps[1:])
    if dist.get_rank() == 0:
        print(f"control word exchange: {word * 1e6:.0f} us (median of {exchanges})")
        print(f"debug-model micro-batch fwd+bwd (1 thread): {step * 1e3:.0f} ms")
        print(f"ratio control word / one micro-batch: {word / step:.5f}")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--exchanges", type=int, default=500)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.exchanges)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, "--worker", f"--exchanges={args.exchanges}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    print(out.stdout, end="")


if __name__ == "__main__":
    main()
