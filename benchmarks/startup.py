"""Start-up cost of a sharded model: per-rank peak memory and time to build, shard and
initialise a model of a few hundred million parameters at 1 and 2 ranks (gloo, CPU), with
each rank computing only its own shards (forge) against building every full value on every
rank and keeping a shard (the way before), measured side by side in one run::

    python benchmarks/startup.py [--dim 1024] [--layers 24] [--vocab 32000]

Memory is the growth of the process's peak RSS over its RSS before the build (the torch
import is common to every case and not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

from forge.cli import summary

REPO = pathlib.Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(out: str, dim: int, layers: int, vocab: int, full_values: bool) -> None:
    """One rank: build on meta, FSDP2 over every rank, materialise, initialise; rank 0
    writes its peak-RSS growth and the seconds taken."""

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from forge.config.sections import ActivationCheckpointing, ModelConfig, Precision
    from forge.model.init import copy_full_, initial_value
    from forge.model.transformer import Transformer, canonical_name
    from forge.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cfg = ModelConfig(dim=dim, n_layers=layers, n_heads=dim // 64, vocab_size=vocab)
    before, start = rss_bytes(), time.perf_counter()
    with torch.device("meta"):
        model = Transformer(cfg)
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    parallelize(
        model,
        tp_mesh=None,
        dp_mesh=mesh,
        precision=Precision.FP32,
        activation_checkpointing=ActivationCheckpointing.NONE,
        compile_blocks=False,
    )
    model.materialize("cpu")
    if full_values:  # every rank draws every full value, then keeps its shard
        for name, p in model.named_parameters():
            key, shape = canonical_name(name), tuple(p.shape)
            copy_full_(p, initial_value(key, shape, cfg, 0))
    else:
        model.init_weights(seed=0)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in model.parameters())
    dist.barrier()
    if dist.get_rank() == 0:
        pathlib.Path(out).write_text(
            json.dumps({"grow": peak - before, "seconds": seconds, "params": params})
        )
    dist.destroy_process_group()


def measure(ranks: int, args: argparse.Namespace, full_values: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", __file__, "--worker", str(out),
               f"--dim={args.dim}", f"--layers={args.layers}", f"--vocab={args.vocab}"]  # fmt: skip
        if full_values:
            cmd.append("--full-values")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--full-values", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.dim, args.layers, args.vocab, args.full_values)
        return
    one = measure(1, args, full_values=False)
    two = measure(2, args, full_values=False)
    old = measure(2, args, full_values=True)
    gib = 2**30
    print(f"CPU figure: gloo, 1 thread per rank, {one['params'] / 1e6:.0f}M parameters, fp32")
    print(f"1 rank:                     {one['grow'] / gib:.2f} GiB, {one['seconds']:.1f} s")
    print(
        f"2 ranks, own shards only:   {two['grow'] / gib:.2f} GiB per rank, {two['seconds']:.1f} s"
    )
    print(
        f"2 ranks, full values (old): {old['grow'] / gib:.2f} GiB per rank, {old['seconds']:.1f} s"
    )
    print(f"per-rank peak memory, 2 ranks / 1 rank: {two['grow'] / one['grow']:.2f}")
    print(f"start-up time, 2 ranks / 1 rank: {two['seconds'] / one['seconds']:.2f} "
          f"(full values on every rank: {old['seconds'] / one['seconds']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
