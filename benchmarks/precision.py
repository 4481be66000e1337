"""forge's training throughput in each precision mode against bare hand-written loops.

One run, KempnerForge's debug shapes (the debug config with 4 KV heads, vocab 32000, FFN 768,
seq 512, batch 4: 19.8M parameters). Three bare loops, each the loop anyone would write by hand:

  (a) fp32 parameters and compute, loss on the fp32 logits;
  (b) fp32 parameters, bf16 autocast, loss on the logits upcast to fp32;
  (c) pure bf16 (parameters, gradients, AdamW state), loss on the bf16 logits (KempnerForge).

against forge's own step (``make_step_fn``: the chunked loss, one host read per step, the
finiteness check, global-norm clipping) in ``fp32``, ``mixed_precision=bf16`` (fp32 master
weights) and ``param_dtype=bf16``; ``--compile`` adds forge with ``train.compile = true``.
Every forge mode runs eager (``train.compile = false``), whatever the default; rounds rotate
the order so that machine noise hits every mode; medians are compared::

    python benchmarks/precision.py [--steps 8] [--rounds 3] [--compile] [--loss-memory]
    python benchmarks/precision.py --base 66b08b1 [--steps 8] [--rounds 4] [--compile]
    python benchmarks/precision.py --base 66b08b1 --only fp32 [--compile] [--rounds 12]

``--base`` measures this script in fresh processes, alternately with this tree's forge and
with the base commit's (a temporary git worktree), one round each, and prints each side's
forge-over-bare ratios (medians over its rounds, with the lowest and highest: one process's
ratio moves by ±10% on a noisy machine): a change to forge's step against the step it
replaces, the bare loops being the same code on both sides. ``--only`` measures one
precision's forge mode and its bare loops, so that more rounds fit in the same time.
``--loss-memory`` also prints the peak memory of one forward + backward of the loss alone,
plain (full fp32 logits) vs chunked, at growing batch sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from worktree import REPO, checked_out, python_with_forge_of  # benchmarks/, beside this script

from forge.cli import summary
from forge.config import load_config
from forge.data.batch import Batch
from forge.metrics.memory import peak_rss_bytes
from forge.model.chunked_loss import LossSpec, chunked_lm_loss
from forge.model.transformer import Transformer, num_parameters
from forge.optim import lr_at, resolve_schedule
from forge.optim.param_groups import param_groups
from forge.training.context import DistContext, RunContext
from forge.training.setup.phases import build_model_and_optim
from forge.training.steps.select import make_step_fn
from forge.types import LoopState

SHAPES = [  # KempnerForge's configs/train/debug.toml (forge's debug config has 2 KV heads)
    "--model.n_kv_heads=4",
    "--model.vocab_size=32000",
    "--model.ffn_hidden_dim=768",
    "--model.max_seq_len=512",
    "--train.seq_len=512",
    "--train.batch_size=4",
    "--train.grad_accum_steps=1",
]

FORGE_MODES = {
    "forge fp32": ["--train.mixed_precision=fp32", "--train.compile=false"],
    "forge mixed bf16": ["--train.mixed_precision=bf16", "--train.compile=false"],
    "forge param_dtype=bf16": [
        "--train.mixed_precision=bf16",
        "--train.param_dtype=bf16",
        "--train.compile=false",
    ],
}
COMPILED = {
    f"{name} + compile": [*a[:-1], "--train.compile=true"] for name, a in FORGE_MODES.items()
}
BARE = {
    "bare (a) fp32": "a",
    "bare (b) bf16 autocast, fp32 loss": "b",
    "bare (c) pure bf16, bf16 loss": "c",
}
ONLY = {"fp32": "forge fp32", "mixed": "forge mixed bf16", "pure": "forge param_dtype=bf16"}


def loops_of(mode: str) -> set[str]:
    """``--only``'s loops: a forge mode and the bare loops it is compared with (``RATIOS``)."""
    assert mode in FORGE_MODES, mode
    return {mode, *(bare for forge, bare in RATIOS if forge == mode)}


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists for the first CPU (empty where there is none)."""
    path = pathlib.Path("/proc/cpuinfo")
    if not path.exists():
        return set()
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def batches(vocab: int, batch: int, seq: int, n: int = 4) -> list[Batch]:
    """``n`` fixed batches of random tokens, shared by every mode."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, batch, seq + 1), generator=gen)
    return [Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def bare_loop(config, mode: str) -> Callable[[list[Batch]], None]:
    """A hand-written step: forward, loss, backward, clip, AdamW (torch's default kernel on
    CPU, as KempnerForge: ``fused`` only on CUDA). ``mode`` is a, b or c."""
    torch.manual_seed(0)
    model = Transformer(config.model)
    if mode == "c":
        model.to(torch.bfloat16)
    # KempnerForge's optimizer: torch's AdamW over the same param groups, fused on CUDA only
    groups = param_groups(model, config.optimizer)
    for g in groups:
        del g["names"]
    o = config.optimizer
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=False)
    schedule = resolve_schedule(config.scheduler, config.train.max_steps)
    clip = config.train.grad_clip_norm or math.inf
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if mode == "b"
        else contextlib.nullcontext
    )
    step = 0

    def run(batch: list[Batch]) -> None:
        nonlocal step
        for group in opt.param_groups:
            group["lr"] = lr_at(schedule, config.optimizer.lr, step)
        b = batch[0]
        with autocast():
            logits = model(b.inputs)
        logits = logits if mode == "c" else logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        step += 1

    return run


def forge_loop(config, workdir: pathlib.Path) -> Callable[[list[Batch]], None]:
    """forge's model build (``build_model_and_optim``) and step function."""
    torch.manual_seed(0)
    run = RunContext(config, pathlib.Path("bench"), workdir, workdir / "checkpoints")
    dist = DistContext()
    mctx = build_model_and_optim(run, dist)
    step_fn = make_step_fn(run, dist, mctx)
    state = LoopState()

    def run_step(batch: list[Batch]) -> None:
        nonlocal state
        result = step_fn(tuple(batch), state)
        state = attrs.evolve(
            state, step=state.step + 1, tokens_seen=state.tokens_seen + result.tokens
        )

    return run_step


def tokens_per_s(step: Callable[[list[Batch]], None], data: list[Batch], steps: int) -> float:
    """Tokens per second over ``steps`` steps (after the caller's warm-up)."""
    start = time.perf_counter()
    for i in range(steps):
        step([data[i % len(data)]])
    return steps * data[0].num_tokens / (time.perf_counter() - start)


def loss_peak_mib(vocab: int, dim: int, tokens: int, chunk: int) -> float:
    """Growth of this process's peak RSS over one forward + backward of the loss alone, fp32
    (``chunk`` 0: the plain path). Run in a fresh process: the peak only ever rises."""
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    before = peak_rss_bytes()
    if chunk > 0:
        chunked_lm_loss(hidden, weight, labels, LossSpec(chunk))[0].backward()
    else:
        F.cross_entropy((hidden @ weight.t()).float(), labels).backward()
    return (peak_rss_bytes() - before) / 2**20


def print_loss_memory(config) -> None:
    vocab, dim, chunk = config.model.vocab_size, config.model.dim, config.train.loss_chunk_size
    print()
    print(f"loss peak memory (RSS growth), forward + backward, vocab {vocab}, dim {dim}, fp32:")
    for tokens in (2048, 8192, 32768):
        mib = {}
        for c in (0, chunk):
            code = (
                "import sys; sys.path.insert(0, 'benchmarks'); import precision; "
                f"print(precision.loss_peak_mib({vocab}, {dim}, {tokens}, {c}))"
            )
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            mib[c] = float(out.stdout.split()[-1])
        print(
            f"  {tokens:>6} tokens: plain {mib[0]:8.1f} MiB, chunked ({chunk}) "
            f"{mib[chunk]:7.1f} MiB; logits alone {tokens * vocab * 4 / 2**20:8.1f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also forge with train.compile")
    parser.add_argument("--loss-memory", action="store_true", help="also the loss's peak memory")
    parser.add_argument("--base", help="a commit whose forge is measured alternately with ours")
    parser.add_argument("--only", choices=sorted(ONLY), help="one precision and its bare loops")
    parser.add_argument("--medians-json", help=argparse.SUPPRESS)  # a --base round's output
    args = parser.parse_args()
    if args.base:
        compare_with_base(args)
        return
    base = load_config([args.config, *SHAPES]).config
    flags = cpu_flags()
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    print(
        f"cpu: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    )
    print(f"bf16 flags: {sorted({'avx512_bf16', 'amx_bf16', 'amx_tile'} & flags) or 'none'}")
    print(
        f"model: {num_parameters(Transformer(base.model)) / 1e6:.1f}M parameters, "
        f"batch {base.train.batch_size} x {base.train.seq_len}"
    )
    data = batches(base.model.vocab_size, base.train.batch_size, base.train.seq_len)
    modes = {**FORGE_MODES, **(COMPILED if args.compile else {})}
    wanted = loops_of(ONLY[args.only]) if args.only else {*BARE, *FORGE_MODES}
    with tempfile.TemporaryDirectory() as tmp:
        loops: dict[str, Callable[[list[Batch]], None]] = {
            name: bare_loop(base, mode) for name, mode in BARE.items() if name in wanted
        }
        for name, extra in modes.items():
            if name.removesuffix(" + compile") not in wanted:
                continue
            config = load_config([args.config, *SHAPES, *extra]).config
            loops[name] = forge_loop(config, pathlib.Path(tmp) / name.replace(" ", "_"))
        for name, loop in loops.items():  # warm-up: allocator, thread pool, compile
            start = time.perf_counter()
            tokens_per_s(loop, data, 2)
            print(f"warm-up {name}: {time.perf_counter() - start:.1f} s")
        rates: dict[str, list[float]] = {name: [] for name in loops}
        names = list(loops)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
            for name in order:
                gc.collect()
                rates[name].append(tokens_per_s(loops[name], data, args.steps))
    med = {name: statistics.median(v) for name, v in rates.items()}
    if args.medians_json:
        pathlib.Path(args.medians_json).write_text(json.dumps(med))
    print()
    for name, v in rates.items():
        print(
            f"{name:38s} {med[name]:8,.0f} tokens/s (rounds: {', '.join(f'{x:,.0f}' for x in v)})"
        )
    print()
    targets = [  # forge mode, bare loop, the ratio it should reach, whether it needs bf16
        ("forge param_dtype=bf16", "bare (c) pure bf16, bf16 loss", 1.10, True),
        ("forge mixed bf16", "bare (c) pure bf16, bf16 loss", 1.0, True),
        ("forge fp32", "bare (a) fp32", 0.97, False),
    ]
    for name in COMPILED if args.compile else ():
        plain = name.removesuffix(" + compile")
        if plain in med:
            print(f"ratio {name} / {plain}: {med[name] / med[plain]:.2f}")
    for mode, bare, target, needs_bf16 in targets:
        if mode not in med:
            continue
        label, ratio = f"{mode} / {bare[:8]}", med[mode] / med[bare]
        if needs_bf16 and not native_bf16:
            verdict = "target skipped: no AVX-512 BF16 / AMX on this CPU"
        else:
            verdict = "meets" if ratio >= target else "MISSES"
            verdict = f"{verdict} target >= {target:.2f}"
        print(f"ratio {label}: {ratio:.3f} ({verdict})")
    if args.loss_memory:
        print_loss_memory(base)


# forge's modes and the bare loop each is measured against
RATIOS = [
    ("forge param_dtype=bf16", "bare (c) pure bf16, bf16 loss"),
    ("forge mixed bf16", "bare (b) bf16 autocast, fp32 loss"),
    ("forge mixed bf16", "bare (c) pure bf16, bf16 loss"),
    ("forge fp32", "bare (a) fp32"),
]
COMPILED_RATIOS = [(f"{mode} + compile", bare) for mode, bare in RATIOS]


def compare_with_base(args: argparse.Namespace) -> None:
    """Each side's forge-over-bare ratios, from ``args.rounds`` alternating processes per
    side (this script, with PYTHONPATH at this tree or at the base's worktree)."""
    with checked_out(args.base) as base, tempfile.TemporaryDirectory() as tmp:
        if base is None:
            return
        sides: dict[str, list[dict[str, float]]] = {"ours": [], "base": []}
        for r in range(args.rounds):
            for side in ("ours", "base") if r % 2 == 0 else ("base", "ours"):
                out = pathlib.Path(tmp) / f"{side}{r}.json"
                root = REPO if side == "ours" else base
                argv = [*python_with_forge_of(root), __file__, "--config", args.config]
                argv += ["--steps", str(args.steps), "--rounds", "1", "--medians-json", str(out)]
                argv += ["--compile"] if args.compile else []
                argv += ["--only", args.only] if args.only else []
                done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
                if done.returncode != 0:
                    sys.exit(f"{side} ({root}) failed:\n{done.stderr[-3000:]}")
                sides[side].append(json.loads(out.read_text()))
    print(f"forge against the bare loops, ours and base {args.base} ({args.rounds} rounds each;")
    print("each side's median over its processes, with their lowest and highest):")
    for mode, bare in [*RATIOS, *(COMPILED_RATIOS if args.compile else [])]:
        if mode not in sides["ours"][0]:
            continue
        ratios = {side: [m[mode] / m[bare] for m in rounds] for side, rounds in sides.items()}
        ours, base = (statistics.median(ratios[side]) for side in ("ours", "base"))
        print(
            f"  {mode} / {bare[:8]}: ours {ours:.3f} ({spread(ratios['ours'])}) | "
            f"base {base:.3f} ({spread(ratios['base'])}) | ours / base {ours / base:.3f}"
        )


def spread(values: list[float]) -> str:
    """The lowest and highest of ``values``, as ``lo-hi``."""
    return f"{min(values):.3f}-{max(values):.3f}"


if __name__ == "__main__":
    main()
