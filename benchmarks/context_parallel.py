"""Context parallelism's memory: per-rank peak memory of one forward + backward of a long
sequence at ``cp`` 1 (one process, plain causal SDPA) and ``cp`` 2 (two ranks, gloo, CPU,
each with its head–tail half of the tokens, keys and values all-gathered)::

    python benchmarks/context_parallel.py [--seq-len 4096] [--dim 256] [--layers 4]

Memory is the growth of the process's peak RSS over its RSS once the model and the batch are
built (weights, torch's import and the process group are common to both and not counted):
the activations, the logits and the gathered keys and values.
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

REPO = pathlib.Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(out: str, args: argparse.Namespace) -> None:
    """One rank: build the model, cut the batch to this rank's tokens, one forward and
    backward; rank 0 writes its peak-RSS growth."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from forge.config.sections import ModelConfig
    from forge.data.context_split import context_shard
    from forge.data.loader import Batch
    from forge.model.transformer import Transformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    cfg = ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, n_kv_heads=args.dim // 128,
        vocab_size=args.vocab, max_seq_len=args.seq_len,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, args.vocab, (1, args.seq_len + 1))
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    if cp > 1:
        model.context_group = dist.group.WORLD
        batch = context_shard(batch, cp, rank)
    kwargs = {"positions": batch.positions} if batch.positions is not None else {}
    dist.barrier()
    before = rss_bytes()
    logits = model(batch.inputs, **kwargs)
    F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps({"grow": peak - before}))
    dist.destroy_process_group()


def measure(ranks: int, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", __file__, "--worker", str(out),
               f"--seq-len={args.seq_len}", f"--dim={args.dim}", f"--layers={args.layers}",
               f"--vocab={args.vocab}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    one, two = measure(1, args), measure(2, args)
    mib = 2**20
    print(
        f"CPU figure: gloo, 1 thread per rank, fp32, seq_len {args.seq_len}, dim {args.dim}, "
        f"{args.layers} layers, vocab {args.vocab}, one row"
    )
    print(f"cp=1: {one['grow'] / mib:.0f} MiB peak growth (forward + backward)")
    print(f"cp=2: {two['grow'] / mib:.0f} MiB per rank")
    print(f"per-rank activation memory, cp=2 / cp=1: {two['grow'] / one['grow']:.2f}")


if __name__ == "__main__":
    main()
