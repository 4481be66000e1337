"""Packed rows against unpacked rows: the step time and peak memory of each attention path.

The debug model at ``--seq`` 4096, batch 2, fp32, forge's own step (``make_step_fn``: the
chunked loss, one host read per step). Four modes, on the same random tokens:

  unpacked          every row one sequence: SDPA ``is_causal`` (the baseline);
  packed, dense     the same tokens packed into documents, SDPA with a ``(B, 1, T, T)``
                    boolean mask (forge before the per-document path: ``Backend.DENSE_MASK``);
  packed, segments  the same documents, SDPA ``is_causal`` per document (``Backend.SEGMENTS``,
                    what ``model.attention = "auto"`` and ``"sdpa"`` run on a CPU).

Document layouts (``--layouts``): ``stdlib`` cuts the windows from the standard library's
files laid end to end, as ``scripts/prepare_data.py`` frames them (BOS + bytes + EOS; most
rows hold one or two documents); ``short`` draws document lengths uniformly from 16-512
tokens; ``tiny`` from 1-32 (the worst case for per-document calls). Step times come from one
process and one model, the modes' rounds rotating so that machine noise hits every mode
(medians compared); each mode's peak resident memory (``VmHWM``) from a fresh process of its
own, over two steps::

    python benchmarks/attention.py [--seq 4096] [--batch 2] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import pathlib
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from unittest import mock

import torch

from forge.cli import summary
from forge.config import load_config
from forge.data.batch import Batch
from forge.data.corpus import stdlib_files, stdlib_root
from forge.data.packing import pack
from forge.metrics.memory import peak_rss_bytes, rss_bytes
from forge.model import transformer
from forge.model.attention import Backend
from forge.training.context import DistContext, RunContext
from forge.training.setup.phases import build_model_and_optim
from forge.training.setup.problems import cpu_flags
from forge.training.steps.select import make_step_fn
from forge.types import LoopState

BOS, EOS = 256, 257  # the byte tokenizer's
MODES = ("unpacked", "packed, dense", "packed, segments")
LAYOUTS = ("stdlib", "short", "tiny")


def document_lengths(layout: str, total: int, rng: random.Random) -> list[int]:
    """Lengths (in tokens, BOS and EOS included) of documents laid end to end, at least
    ``total`` tokens of them."""
    if layout == "stdlib":
        sizes = [p.stat().st_size + 2 for p in stdlib_files(stdlib_root())]
        start = rng.randrange(len(sizes))
        sizes = sizes[start:] + sizes[:start]  # a random place in the corpus
    else:
        low, high = (16, 512) if layout == "short" else (1, 32)
        sizes = [rng.randint(low, high) for _ in range(total // low + 1)]
    out, n = [], 0
    for size in sizes:
        out.append(size)
        n += size
        if n >= total:
            break
    return out


def windows(layout: str, rows: int, seq: int, seed: int) -> torch.Tensor:
    """``(rows, seq + 1)`` tokens: random bytes, BOS and EOS where the layout's documents
    start and end (a document of length 1 is a lone BOS)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = torch.randint(0, 256, (rows, seq + 1), generator=gen)
    for r in range(rows):
        lengths = document_lengths(layout, 64 * seq, rng)
        offset = rng.randrange(max(1, sum(lengths) - seq - 1))  # a window inside the stream
        stream = torch.zeros(sum(lengths), dtype=torch.bool)
        ends = torch.zeros_like(stream)
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        stream[starts] = True
        ends[starts[1:] - 1] = True
        window = slice(offset, offset + seq + 1)
        out[r][ends[window]] = EOS
        out[r][stream[window]] = BOS
    return out


def batch_of(mode: str, layout: str, rows: int, seq: int, seed: int) -> Batch:
    """One micro-batch of ``mode``: the same tokens, packed or not."""
    tokens = windows(layout, rows, seq, seed)
    if mode == "unpacked":
        return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    p = pack(tokens, BOS)
    return Batch(p.inputs, p.labels, positions=p.positions, document_ids=p.document_ids)


def forge_step(seq: int, rows: int) -> Callable[[Batch, int], None]:
    """forge's model build and step function for the debug model at ``seq`` x ``rows``."""
    config = load_config(
        [
            "configs/train/debug.toml",
            f"--model.max_seq_len={seq}",
            f"--train.seq_len={seq}",
            f"--train.batch_size={rows}",
            "--train.grad_accum_steps=1",
            "--train.compile=false",
        ]
    ).config
    torch.manual_seed(0)
    tmp = pathlib.Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, tmp, True)  # nothing is written there; removed at exit
    run = RunContext(config, pathlib.Path("bench"), tmp, tmp)
    dist = DistContext()
    step_fn = make_step_fn(run, dist, build_model_and_optim(run, dist))

    def step(batch: Batch, i: int) -> None:
        step_fn((batch,), LoopState(step=i))

    return step


def backend_of(mode: str) -> contextlib.AbstractContextManager:
    """``packed, dense`` forces the old path: one boolean ``(B, 1, T, T)`` mask."""
    if mode == "packed, dense":
        return mock.patch.object(transformer, "choose_backend", return_value=Backend.DENSE_MASK)
    return contextlib.nullcontext()


def step_times(step: Callable[[Batch, int], None], data: list[Batch], mode: str) -> float:
    """Median seconds per step of ``mode`` over ``data``."""
    times = []
    with backend_of(mode):
        for i, batch in enumerate(data):
            start = time.perf_counter()
            step(batch, i)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_memory(mode: str, layout: str, seq: int, rows: int) -> tuple[int, int]:
    """In this (fresh) process: the peak RSS over two steps of ``mode``, and its growth over
    the RSS before them (the model and optimizer built)."""
    step = forge_step(seq, rows)
    data = [batch_of(mode, layout, rows, seq, seed) for seed in range(2)]
    before = rss_bytes()
    step_times(step, data, mode)
    peak = max(peak_rss_bytes(), rss_bytes())
    return peak, peak - before


def peak_in_fresh_process(mode: str, layout: str, seq: int, rows: int) -> tuple[int, int]:
    """``peak_memory`` in a process of its own: the peak only ever rises."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import attention; "
        f"print(*attention.peak_memory({mode!r}, {layout!r}, {seq}, {rows}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak, growth = out.stdout.split()[-2:]
    return int(peak), int(growth)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    flags = cpu_flags()
    print(
        f"cpu: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} "
        f"threads, avx512: {'avx512f' in flags}"
    )
    print(f"debug model, batch {args.batch} x {args.seq}, fp32, forge's step (eager)")
    jobs = [("unpacked", "stdlib")] + [(m, la) for la in layouts for m in MODES[1:]]
    step = forge_step(args.seq, args.batch)
    data = {
        job: [batch_of(*job, args.batch, args.seq, seed) for seed in range(args.steps)]
        for job in jobs
    }
    for layout in layouts:
        packed = [
            batch_of("packed, dense", layout, args.batch, args.seq, s) for s in range(args.steps)
        ]
        counts = [len(set(r.tolist())) for b in packed for r in b.document_ids]
        print(f"layout {layout}: documents per row {counts}")
    for job in jobs:  # warm-up: allocator, thread pool, each layout's shapes
        step_times(step, data[job][:1], job[0])
    times: dict[tuple[str, str], list[float]] = {job: [] for job in jobs}
    for r in range(args.rounds):
        for job in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:  # rotate who goes first
            times[job].append(step_times(step, data[job], job[0]))
    memory = {job: peak_in_fresh_process(*job, args.seq, args.batch) for job in jobs}
    base = statistics.median(times[jobs[0]]), *memory[jobs[0]]
    print(f"{'mode':28s} {'step s':>7s} {'peak MiB':>9s} {'growth MiB':>10s}   time   peak growth")
    for (mode, layout), t in times.items():
        name = mode if mode == "unpacked" else f"{mode} ({layout})"
        m = (statistics.median(t), *memory[(mode, layout)])
        print(
            f"{name:28s} {m[0]:7.2f} {m[1] / 2**20:9.0f} {m[2] / 2**20:10.0f}  "
            + " ".join(f"{x / b:5.2f}x" for x, b in zip(m, base, strict=True))
        )


if __name__ == "__main__":
    main()
