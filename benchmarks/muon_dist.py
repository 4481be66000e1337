"""Muon's optimizer step under FSDP2: owner-computes Newton–Schulz against gather-everything.

The debug model's matrices (``configs/train/debug.toml``'s model: 28 Muon matrices of 256 ×
256, 128 × 256 and 704 × 256, AdamW for the embedding, head and norms), FSDP2-sharded over 1,
2 and 4 ranks (torchrun, gloo, CPU, one thread per rank). At each rank count both optimizers
step the same sharded model in one launch, side by side in ABBA rounds (medians compared):

  gather-everything: every rank gathers every matrix and orthogonalises all of them;
  distributed: each rank orthogonalises its share, two ``all_to_all``s per step.

At 1 rank nothing is sharded and the two paths are the same code (a control)::

    python benchmarks/muon_dist.py [--steps 5] [--rounds 4] [--ranks 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from forge.cli import summary
from forge.config import OptimizerConfig, load_config
from forge.config.optim import OptimizerName
from forge.model.transformer import Transformer
from forge.optim.optimizers import MuonAdamW
from forge.optim.param_groups import param_groups
from forge.training.setup.problems import cpu_flags

REPO = pathlib.Path(__file__).resolve().parents[1]
MODES = ("gather-everything", "distributed")


def debug_model(config: str, world: int) -> Transformer:
    """The config's model, FSDP2-sharded per block and at the root over ``world`` ranks (as
    it is in training; plain at one rank), with a fixed random gradient on every parameter."""
    torch.manual_seed(0)
    model = Transformer(load_config([config]).config.model)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        grad = torch.randn(p.shape, generator=gen)
        if isinstance(p, DTensor):
            grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = grad
    return model


def optimizers(model: Transformer) -> dict[str, MuonAdamW]:
    """The two optimizers over the model's Muon / AdamW groups (same hyper-parameters)."""
    cfg = OptimizerConfig(name=OptimizerName.MUON, lr=3e-3)
    out = {}
    for mode in MODES:
        groups = param_groups(model, cfg)
        for g in groups:
            del g["names"]
        out[mode] = MuonAdamW(groups, lr=cfg.lr, distributed_ns=mode == "distributed")
    return out


def seconds_per_step(opt: MuonAdamW, steps: int) -> float:
    """Wall time of ``steps`` optimizer steps over the slowest rank (barriers either side)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def worker(config: str, steps: int, rounds: int, out: str) -> None:
    """One rank: both optimizers, warmed up, then ``rounds`` ABBA rounds of ``steps`` each."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = debug_model(config, dist.get_world_size())
    opts = optimizers(model)
    for opt in opts.values():  # warm-up: state, allocator
        seconds_per_step(opt, 2)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            times[mode].append(seconds_per_step(opts[mode], steps))
    if dist.get_rank() == 0:
        pathlib.Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def launch(config: str, ranks: int, steps: int, rounds: int, out: pathlib.Path) -> dict:
    """Run ``worker`` on ``ranks`` torchrun ranks; rank 0's times."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", __file__, "--worker", str(out),
           f"--config={config}", f"--steps={steps}", f"--rounds={rounds}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set by launch: the output file
    args = parser.parse_args()
    if args.worker:
        worker(args.config, args.steps, args.rounds, args.worker)
        return
    flags = cpu_flags()
    cores = os.cpu_count() or 1
    print(
        f"cpu: {platform.processor() or platform.machine()}, {cores} cores, torch "
        f"{torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"avx512: {'avx512f' in flags}; gloo, 1 thread per rank, fp32; load average "
        f"{os.getloadavg()[0]:.2f} at the start (other processes share the cores)"
    )
    print("debug model's matrices, FSDP2 per block; the whole optimizer step (Muon + AdamW)")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (int(r) for r in args.ranks.split(",")):
            times = launch(args.config, ranks, args.steps, args.rounds, pathlib.Path(tmp) / "t")
            gather, ours = (statistics.median(times[mode]) * 1e3 for mode in MODES)
            note = f" (oversubscribed: {ranks} ranks on {cores} cores)" if ranks > cores else ""
            print(
                f"{ranks} rank(s): gather-everything {gather:7.1f} ms/step, distributed "
                f"{ours:7.1f} ms/step, ratio {gather / ours:.2f}x{note}"
            )


if __name__ == "__main__":
    main()
