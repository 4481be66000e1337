"""Multi-token prediction's cost: forge's step with ``model.mtp_depth=1`` against ``mtp_depth=0``.

forge's own training step (``make_step_fn``: the chunked loss, AdamW, clipping; eager,
``train.compile = false``) on the same model with one multi-token depth and without, built in
the same process and timed in alternating rounds (ABBA), medians compared. Configs: ``debug``
(configs/train/debug.toml: dim 256, 4 layers, vocab 259, 4 rows x 256 tokens x 2
micro-batches a step), ``wide`` (the same at dim 512, 8 layers, 8 heads, 4 KV heads) and
``vocab32k`` (debug at vocab 32000); each in fp32 and in pure bf16 (``param_dtype=bf16``),
the latter only where the CPU computes bf16 natively (AVX-512 BF16 or AMX; emulated bf16 ran
24x slower than fp32, docs/benchmarks.md).

The issue's target is a step at most ``TARGET`` x the step without MTP. A depth is one more
transformer block, a projection of twice the width and one more pass through the output head,
so ``forge.metrics.flops.flops_per_token``'s ratio is printed beside the measured one: where it
is above the target, no implementation reaches it on those shapes. The extra time of a depth
is split by hooks (separate, untimed steps) into its module's forward and backward, its head
pass (the chunked loss computes its gradients in forward) and the rest, beside one main
block's and the main head's time.

Peak memory, each case in a fresh process: the process's peak RSS (``VmHWM``) over
``--memory-steps`` steps and its growth over the RSS after the build (the allocator's caching
and the optimizer state included), then the peak of the bytes allocated during one more step
(the profiler's CPU allocation events, ``profile_memory``) and the largest allocations live at
that peak. At vocab 32000 the losses run chunked (``train.loss_chunk_size``, the default) and
plain (0), and every tensor autograd saves with a vocab dimension is listed: with the chunked
loss no logits-sized one (a micro-batch's tokens x vocab) may be among them::

    python benchmarks/mtp.py [--configs debug,wide,vocab32k] [--precisions fp32,bf16]
        [--steps 3] [--rounds 4] [--warmup 2] [--parts timing,memory] [--memory-steps 2]
        [--out mtp.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from math import prod
from unittest import mock

import attrs
import torch
from torch._C._profiler import _ExtraFields_Allocation

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: forge from this checkout

from forge.cli import summary  # noqa: E402
from forge.config import load_config  # noqa: E402
from forge.data.batch import Batch  # noqa: E402
from forge.errors import print_errors  # noqa: E402
from forge.metrics.flops import flops_per_token  # noqa: E402
from forge.metrics.memory import peak_rss_bytes, rss_bytes  # noqa: E402
from forge.model import mtp as mtp_module  # noqa: E402
from forge.model import transformer as transformer_module  # noqa: E402
from forge.model.transformer import num_parameters  # noqa: E402
from forge.outputs import file_output_problem, replace_file  # noqa: E402
from forge.training.context import DistContext, RunContext  # noqa: E402
from forge.training.setup.phases import build_model_and_optim  # noqa: E402
from forge.training.setup.problems import cpu_flags  # noqa: E402
from forge.training.steps.select import make_step_fn  # noqa: E402
from forge.types import LoopState  # noqa: E402

TARGET = 1.10  # step time with one depth / without
NOISY = 1.15  # the slowest round over the fastest of one model above which a ratio is noise
BASE = str(REPO / "configs" / "train" / "debug.toml")
# eager in both precisions (compile is another comparison); the first step computed once, not
# replayed (resilience.replay_first_step): the memory measured is a plain step's
COMMON = ["--train.compile=false", "--resilience.replay_first_step=false"]
CONFIGS = {
    "debug": [],
    "wide": ["--model.dim=512", "--model.n_layers=8", "--model.n_heads=8", "--model.n_kv_heads=4"],
    "vocab32k": ["--model.vocab_size=32000"],
}
PRECISIONS = {
    "fp32": ["--train.mixed_precision=fp32"],
    "bf16": ["--train.mixed_precision=bf16", "--train.param_dtype=bf16"],
}
MEMORY_VOCAB = ["--model.vocab_size=32000", "--train.mixed_precision=fp32"]
PRESETS = ("llama3_1b", "llama3_8b", "qwen3_0_6b", "deepseek_moe_16b")
MIB = 2**20


def config_of(overrides: Sequence[str]):
    """The debug config with ``overrides`` (and eager compute)."""
    return load_config([BASE, *COMMON, *overrides]).config


def flops_ratio(overrides: Sequence[str], base: str = BASE) -> float:
    """``flops_per_token`` with one depth over without, for ``overrides`` of ``base``."""
    flops = []
    for depth in (0, 1):
        cfg = load_config([base, *overrides, f"--model.mtp_depth={depth}"]).config
        flops.append(flops_per_token(cfg.model, cfg.train.seq_len))
    return flops[1] / flops[0]


def step_batches(cfg, n: int = 2) -> list[tuple[Batch, ...]]:
    """``n`` steps of random tokens (``grad_accum_steps`` micro-batches each), unpacked rows."""
    gen = torch.Generator().manual_seed(0)
    t = cfg.train
    shape = (n, t.grad_accum_steps, t.batch_size, t.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    return [
        tuple(Batch(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in step) for step in tokens
    ]


@attrs.define
class Loop:
    """forge's model, optimizer and step on fixed batches."""

    model: torch.nn.Module
    step_fn: Callable
    data: list[tuple[Batch, ...]]
    state: LoopState = attrs.field(factory=LoopState)

    def run(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps; every step must apply its update."""
        start = time.perf_counter()
        for _ in range(steps):
            result = self.step_fn(self.data[self.state.step % len(self.data)], self.state)
            if not result.applied:
                raise RuntimeError(f"step {self.state.step + 1} was not applied: {result}")
            self.state = attrs.evolve(self.state, step=self.state.step + 1)
        return (time.perf_counter() - start) / steps


def build(cfg, workdir: pathlib.Path) -> Loop:
    """forge's model build (``build_model_and_optim``) and step function for ``cfg``."""
    torch.manual_seed(0)
    run = RunContext(cfg, pathlib.Path("bench"), workdir, workdir / "checkpoints")
    dist = DistContext()
    mctx = build_model_and_optim(run, dist)
    return Loop(mctx.model, make_step_fn(run, dist, mctx), step_batches(cfg))


class Stopwatch:
    """Seconds summed per part, from hooks and wrapped functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started: dict[str, float] = {}

    def start(self, part: str) -> None:
        self.started[part] = time.perf_counter()

    def stop(self, part: str) -> None:
        elapsed = time.perf_counter() - self.started.pop(part)
        self.seconds[part] = self.seconds.get(part, 0.0) + elapsed

    def hook(self, module: torch.nn.Module, name: str) -> list:
        """Forward and backward hooks timing ``module`` as ``name fwd`` / ``name bwd``."""
        return [
            module.register_forward_pre_hook(lambda *_: self.start(f"{name} fwd")),
            module.register_forward_hook(lambda *_: self.stop(f"{name} fwd")),
            module.register_full_backward_pre_hook(lambda *_: self.start(f"{name} bwd")),
            module.register_full_backward_hook(lambda *_: self.stop(f"{name} bwd")),
        ]

    def wrap(self, fn: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            self.start(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop(name)

        return timed


@contextlib.contextmanager
def timed_parts(loop: Loop, watch: Stopwatch) -> Iterator[None]:
    """Hooks on the first depth and the first main block, and the two heads' loss timed."""
    model = loop.model
    handles = watch.hook(model.mtp["1"], "depth module") + watch.hook(  # type: ignore[index]
        model.layers["0"],  # type: ignore[index]
        "main block",
    )
    depth_loss = watch.wrap(mtp_module.depth_loss_sum, "depth head")
    main_loss = watch.wrap(transformer_module.chunked_lm_loss, "main head")
    try:
        with (
            mock.patch.object(mtp_module, "depth_loss_sum", depth_loss),
            mock.patch.object(transformer_module, "chunked_lm_loss", main_loss),
        ):
            yield
    finally:
        for h in handles:
            h.remove()


def attribution(loop: Loop, steps: int, extra_s: float) -> dict[str, float]:
    """Milliseconds per step of the depth's parts (over ``steps`` hooked steps), the rest of
    the measured extra ``extra_s``, and one main block's and the main head's for scale."""
    watch = Stopwatch()
    with timed_parts(loop, watch):
        loop.run(steps)
    ms = {k: v * 1e3 / steps for k, v in watch.seconds.items()}
    parts = {
        "depth module fwd": ms.get("depth module fwd", 0.0),
        "depth module bwd": ms.get("depth module bwd", 0.0),
        "depth head": ms.get("depth head", 0.0),
    }
    parts["rest"] = extra_s * 1e3 - sum(parts.values())
    parts["main block fwd+bwd"] = ms.get("main block fwd", 0.0) + ms.get("main block bwd", 0.0)
    parts["main head"] = ms.get("main head", 0.0)
    return {k: round(v, 2) for k, v in parts.items()}


def time_case(name: str, precision: str, args: argparse.Namespace) -> dict:
    """Both depths of one config and precision, timed in alternating rounds."""
    overrides = [*CONFIGS[name], *PRECISIONS[precision]]
    cfgs = [config_of([*overrides, f"--model.mtp_depth={d}"]) for d in (0, 1)]
    with tempfile.TemporaryDirectory() as tmp:
        loops = [build(cfg, pathlib.Path(tmp) / f"d{d}") for d, cfg in enumerate(cfgs)]
        for loop in loops:
            loop.run(args.warmup)
        times: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for d in (0, 1) if r % 2 == 0 else (1, 0):  # ABBA: neither always goes first
                gc.collect()
                times[d].append(loops[d].run(args.steps))
        med = [statistics.median(t) for t in times]
        parts = attribution(loops[1], args.steps, med[1] - med[0])
    m = cfgs[0].model
    return {
        "config": name,
        "precision": precision,
        "shape": f"dim {m.dim}, {m.n_layers} layers, vocab {m.vocab_size}, "
        f"seq {cfgs[0].train.seq_len}",
        "parameters": [num_parameters(loop.model) for loop in loops],
        "ms_per_step": [round(t * 1e3, 2) for t in med],
        "rounds_ms": [[round(t * 1e3, 1) for t in ts] for ts in times],
        "ratio": round(med[1] / med[0], 4),
        "rounds_spread": round(max(max(t) / min(t) for t in times), 3),
        "flops_ratio": round(flops_ratio(overrides), 4),
        "extra_ms": parts,
    }


class SavedVocabWide:
    """Autograd's saved tensors with a dimension of ``vocab``, once per storage: their shapes,
    and which are logits-sized (at least ``tokens`` x ``vocab`` elements)."""

    def __init__(self, vocab: int, tokens: int) -> None:
        self.vocab, self.tokens = vocab, tokens
        self.seen: dict[int, tuple[tuple[int, ...], int]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.vocab in t.shape:
            storage = t.untyped_storage()
            self.seen[storage.data_ptr()] = (tuple(t.shape), storage.nbytes())
        return t

    def logits(self) -> list[int]:
        """The bytes of each logits-sized one."""
        return [n for shape, n in self.seen.values() if prod(shape) >= self.tokens * self.vocab]


def allocator_peak(prof: torch.profiler.profile) -> tuple[int, list[tuple[float, str]]]:
    """From a profile with ``profile_memory``: the peak of the bytes allocated since it began
    (CPU allocator events) and the largest allocations live at that peak (MiB, the op)."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the profile holds no results")
    events, stack = [], list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if isinstance(fields := e.extra_fields, _ExtraFields_Allocation):
            op = e.parent.name if e.parent is not None else "?"
            events.append((e.start_time_ns, fields.ptr, fields.alloc_size, op))
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for _, ptr, size, op in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = (size, op)
        else:
            live.pop(ptr, None)
        now += size
        if now > peak:
            peak, at_peak = now, dict(live)
    largest = sorted(at_peak.values(), reverse=True)[:6]
    return peak, [(round(n / MIB, 1), op) for n, op in largest]


def memory_child(overrides: Sequence[str], steps: int) -> dict:
    """One case in this (fresh) process: the peak RSS over ``steps`` steps after the build,
    the saved vocab-wide tensors of the first, then one more step under the profiler for the
    allocator's peak."""
    cfg = config_of(overrides)
    tokens = cfg.train.batch_size * cfg.train.seq_len  # one micro-batch's
    saved = SavedVocabWide(cfg.model.vocab_size, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        loop = build(cfg, pathlib.Path(tmp))
        before = rss_bytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loop.run(1)
        loop.run(steps - 1)
        peak = max(peak_rss_bytes(), rss_bytes())
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
            loop.run(1)
    step_peak, largest = allocator_peak(prof)
    return {
        "peak_mib": round(peak / MIB, 1),
        "growth_mib": round((peak - before) / MIB, 1),
        "step_alloc_peak_mib": round(step_peak / MIB, 1),
        "largest_at_peak": largest,
        "saved_vocab_wide": dict(Counter(str(list(s)) for s, _ in saved.seen.values())),
        "saved_logits": len(saved.logits()),
        "saved_logits_mib": round(sum(saved.logits()) / MIB, 1),
        "logits_mib": round(tokens * cfg.model.vocab_size * 4 / MIB, 1),
    }


def measure_memory(overrides: Sequence[str], steps: int) -> dict:
    """``memory_child`` in a fresh process (the peak RSS only ever rises)."""
    argv = [sys.executable, __file__, "--memory-case", json.dumps(list(overrides))]
    done = subprocess.run(
        [*argv, "--memory-steps", str(steps)], capture_output=True, text=True, cwd=REPO
    )
    if done.returncode != 0:
        sys.exit(f"memory case {overrides} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> dict:
    flags = cpu_flags()
    name = ""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    return {
        "cpu": name or platform.processor() or platform.machine(),
        "flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
        "native_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "load_average_start": round(os.getloadavg()[0], 2),
    }


def print_timing(case: dict) -> None:
    ms, ratio, flops = case["ms_per_step"], case["ratio"], case["flops_ratio"]
    verdict = "meets" if ratio <= TARGET else "MISSES"
    why = f"; the FLOPs alone are {flops:.2f}x: out of reach here" if flops > TARGET else ""
    print(
        f"{case['config']} {case['precision']} ({case['shape']}): mtp_depth=0 {ms[0]:.1f} "
        f"ms/step, mtp_depth=1 {ms[1]:.1f} ms/step (rounds: {case['rounds_ms'][0]} / "
        f"{case['rounds_ms'][1]})"
    )
    print(f"  ratio {ratio:.3f} (FLOP ratio {flops:.3f}; {verdict} target <= {TARGET:.2f}{why})")
    spread = max(max(r) / min(r) for r in case["rounds_ms"])
    if spread > NOISY:
        print(
            f"  warning: one depth's rounds differ by up to {spread:.2f}x (another process on "
            "the CPU?): this ratio is not to be trusted; measure again on a quiet machine"
        )
    p = case["extra_ms"]
    print(
        f"  the extra {ms[1] - ms[0]:.1f} ms/step: depth module fwd {p['depth module fwd']:.1f} "
        f"+ bwd {p['depth module bwd']:.1f}, its head pass {p['depth head']:.1f}, the rest "
        f"{p['rest']:.1f} (embedding, targets, optimizer); for scale, one main block fwd+bwd "
        f"{p['main block fwd+bwd']:.1f}, the main head {p['main head']:.1f}"
    )


def print_memory(label: str, m: dict) -> None:
    print(
        f"  {label:24s} peak RSS {m['peak_mib']:7.1f} MiB (+{m['growth_mib']:6.1f} over the "
        f"build); a step's allocator peak {m['step_alloc_peak_mib']:6.1f} MiB; logits-sized "
        f"tensors saved: {m['saved_logits']} ({m['saved_logits_mib']:.1f} MiB)"
    )
    largest = ", ".join(f"{n} {op}" for n, op in m["largest_at_peak"])
    print(f"  {'':24s} largest live at the allocator peak (MiB): {largest}")


def is_report(path: pathlib.Path) -> bool:
    """Whether ``path`` holds a report this script wrote (it may be written over)."""
    try:
        return json.loads(path.read_text()).get("benchmark") == "mtp"
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def option_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.out is not None:
        problem = file_output_problem(args.out, "--out", "mtp", is_report)
        problems += [problem] if problem else []
    for option, value, known in (
        ("--configs", args.configs, CONFIGS),
        ("--precisions", args.precisions, PRECISIONS),
        ("--parts", args.parts, ("timing", "memory")),
    ):
        unknown = [v for v in value if v not in known]
        if unknown or not value:
            problems.append(f"{option}: {unknown or 'empty'}; choose from {', '.join(known)}")
    for option in ("steps", "rounds", "memory_steps"):
        if getattr(args, option) < 1:
            problems.append(f"--{option.replace('_', '-')}: must be >= 1")
    if args.warmup < 0:
        problems.append("--warmup: must be >= 0")
    return problems


def memory_cases(args: argparse.Namespace, precisions: Sequence[str]) -> list[dict]:
    """Every timed case's memory, then vocab 32000's with the chunked and the plain loss."""
    print()
    print(f"peak memory, a fresh process per case, {args.memory_steps} steps:")
    memory = []
    for name in args.configs:
        for precision in precisions:
            for depth in (0, 1):
                overrides = [*CONFIGS[name], *PRECISIONS[precision], f"--model.mtp_depth={depth}"]
                m = measure_memory(overrides, args.memory_steps)
                memory.append({"config": name, "precision": precision, "depth": depth} | m)
                print_memory(f"{name} {precision} mtp_depth={depth}", m)
    chunk = config_of([]).train.loss_chunk_size
    print(f"vocab 32000, fp32, the losses (main and depth) chunked ({chunk} tokens) and plain:")
    logits = None
    for loss, size in (("chunked", chunk), ("plain", 0)):
        for depth in (0, 1):
            overrides = [*MEMORY_VOCAB, f"--model.mtp_depth={depth}"]
            m = measure_memory([*overrides, f"--train.loss_chunk_size={size}"], args.memory_steps)
            memory.append({"config": "vocab32k", "loss": loss, "depth": depth} | m)
            print_memory(f"{loss} mtp_depth={depth}", m)
            shapes = ", ".join(f"{n} x {shape}" for shape, n in m["saved_vocab_wide"].items())
            print(f"  {'':24s} saved for backward with a vocab dimension: {shapes}")
            logits = m["logits_mib"]
    print(f"  (one micro-batch's fp32 logits: {logits} MiB)")
    return memory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--configs", default="debug,wide,vocab32k", type=lambda s: s.split(","))
    parser.add_argument("--precisions", default="fp32,bf16", type=lambda s: s.split(","))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per depth and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, ABBA order")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--parts", default="timing,memory", type=lambda s: s.split(","))
    parser.add_argument("--memory-steps", type=int, default=2, help="steps per memory case")
    parser.add_argument("--out", type=pathlib.Path, help="also write the report as JSON")
    parser.add_argument("--memory-case", help=argparse.SUPPRESS)  # a child: one memory case
    args = parser.parse_args(argv)
    if args.memory_case is not None:
        print(json.dumps(memory_child(json.loads(args.memory_case), args.memory_steps)))
        return 0
    problems = option_problems(args)
    if problems:
        print_errors(problems)
        return 2
    info = machine()
    print(
        f"cpu: {info['cpu']}, flags: {', '.join(info['flags']) or 'none of avx2/avx512'}; "
        f"torch {info['torch']}, capability {info['capability']}, {info['threads']} threads; "
        f"load average {info['load_average_start']:.2f} at the start"
    )
    precisions = list(args.precisions)
    if "bf16" in precisions and not info["native_bf16"]:
        precisions.remove("bf16")
        print("bf16: skipped, no AVX-512 BF16 / AMX on this CPU (emulated bf16 is ~24x slower)")
    print(
        f"forge's step, eager, mtp_depth=1 against 0; medians of {args.rounds} rounds of "
        f"{args.steps} steps (ABBA) after {args.warmup} warm-up steps; target ratio <= {TARGET}"
    )
    presets = {p: round(flops_ratio([], str(REPO / f"configs/train/{p}.toml")), 3) for p in PRESETS}
    print(
        "FLOP ratio with one depth, presets at their seq_len: "
        + ", ".join(f"{p} {r:.3f}" for p, r in presets.items())
    )
    print()
    timings = []
    for name in args.configs if "timing" in args.parts else ():
        for precision in precisions:
            timings.append(time_case(name, precision, args))
            print_timing(timings[-1])
    memory = memory_cases(args, precisions) if "memory" in args.parts else []
    report = {
        "benchmark": "mtp",
        "machine": info | {"load_average_end": round(os.getloadavg()[0], 2)},
        "target": TARGET,
        "presets_flops_ratio": presets,
        "timing": timings,
        "memory": memory,
    }
    if args.out is not None:
        replace_file(args.out, json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
