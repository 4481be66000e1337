"""Context parallelism's memory: per-rank peak memory of one forward + backward of a long
sequence at ``cp`` 1 (one process, plain causal SDPA) and ``cp`` 2 (two ranks, gloo, CPU,
each with its head–tail half of the tokens, keys and values all-gathered)::

    python benchmarks/context_parallel.py [--seq-len 4096] [--dim 256] [--layers 4]

Memory is the growth of the process's peak RSS over its RSS once the model and the batch are
built (weights, torch's import and the process group are common to both and not counted):
the activations, the logits and the gathered keys and values. glibc's mmap threshold is fixed
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident set at once and the peak
is the peak of live memory, not of the heap's high-water mark.

Then both run again under a per-rank memory budget halfway between the two peaks (a limit on
the data segment's growth, ``RLIMIT_DATA``): the sequence that does not fit one rank trains
at ``cp=2``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

from forge.cli import summary

REPO = pathlib.Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def data_bytes() -> int:
    """The process's data segment now (``VmData``: what ``RLIMIT_DATA`` limits)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmData:"))
    return int(line.split()[1]) * 1024


def worker(out: str, args: argparse.Namespace) -> None:
    """One rank: build the model, cut the batch to this rank's tokens, one forward and
    backward; rank 0 writes its peak-RSS growth."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from forge.config.sections import ModelConfig
    from forge.data.batch import Batch
    from forge.data.context_split import context_shard
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
    if args.budget_mib:
        limit = data_bytes() + args.budget_mib * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
    try:
        logits = model(batch.inputs, **kwargs)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())
        loss.backward()
        result = {"loss": loss.item()}
    except (RuntimeError, MemoryError) as e:  # the allocator's "can't allocate memory"
        result = {"error": str(e).splitlines()[0].split("DefaultCPUAllocator: ")[-1].split(".")[0]}
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    result["grow"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(result))
    if "error" not in result:  # a rank out of memory left its peer inside a collective
        dist.destroy_process_group()


def measure(ranks: int, args: argparse.Namespace, budget_mib: int = 0) -> dict[str, float]:
    """Rank 0's result (its peak growth, its loss or its allocation error) of one forward and
    backward at ``ranks`` context-parallel ranks, under ``budget_mib`` per rank (0: none)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", __file__, "--worker", str(out),
               f"--seq-len={args.seq_len}", f"--dim={args.dim}", f"--layers={args.layers}",
               f"--vocab={args.vocab}", f"--budget-mib={budget_mib}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
               "MALLOC_MMAP_THRESHOLD_": "65536"}  # fmt: skip
        stderr = ""
        # a rank out of memory can leave its peer in a collective: rank 0 has written by then
        with contextlib.suppress(subprocess.TimeoutExpired):
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            stderr = run.stderr
        if not out.exists():
            raise SystemExit(f"cp={ranks}: no result from rank 0\n{stderr[-3000:]}")
        return json.loads(out.read_text())


def attention_times(args: argparse.Namespace) -> tuple[float, float]:
    """Seconds (best of 3) of rank 0's attention forward and backward at ``cp=2`` in one
    layer's shapes, block by block and as SDPA under the one dense mask it replaced."""
    import time

    import torch
    import torch.nn.functional as F

    from forge.model.block_attention import block_attention, dense_keep, key_blocks

    torch.set_num_threads(1)
    torch.manual_seed(0)
    t, heads = args.seq_len, args.dim // 64
    q = torch.randn(1, heads, t // 2, 64, requires_grad=True)
    k, v = (torch.randn(1, heads // 2, t, 64, requires_grad=True) for _ in range(2))
    blocks = key_blocks(t, 2, 0, 0)
    keep = dense_keep(blocks, t // 2, t, q.device)
    bias = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))

    def best(attend) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            attend().sum().backward()
            times.append(time.perf_counter() - start)
        return min(times)

    dense = best(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))
    return best(lambda: block_attention(q, k, v, blocks)), dense


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--budget-mib", type=int, default=0, help=argparse.SUPPRESS)
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
    blocks, dense = attention_times(args)
    print(
        f"one layer's attention at cp=2 (fwd+bwd): blocks {blocks * 1e3:.0f} ms, one dense mask "
        f"{dense * 1e3:.0f} ms: {dense / blocks:.2f}x"
    )
    budget = round((one["grow"] + two["grow"]) / 2 / mib)
    for ranks in (1, 2):
        run = measure(ranks, args, budget)
        told = "trains (forward and backward)" if "loss" in run else f"fails: {run['error']}"
        print(f"under a budget of {budget} MiB per rank, cp={ranks} {told}")


if __name__ == "__main__":
    main()
