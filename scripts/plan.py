"""Size a config before launching: ``python scripts/plan.py CONFIG [--overrides] --nproc N``.

Prints the parameter counts, the FLOPs per token, and one rank's estimated peak memory for the
layout the config's ``[distributed]`` keys give at ``--nproc`` ranks — weights, gradients,
optimizer state, FSDP's gathered blocks, activations (with and without activation
checkpointing) and the loss — and whether it fits ``--gpu-memory-gb``. Nothing is allocated:
the model is counted from its config (``forge/parallel/memory_plan.py`` says what is counted).
"""

from __future__ import annotations

import argparse

from forge.cli import help_first, summary


def parser() -> argparse.ArgumentParser:
    """plan.py's own options (the config and its overrides follow), built before torch is
    imported (``help_first``)."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks in the job (the world size)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per device, GiB")
    return parser


help_first(__name__, lambda args: parser().parse_known_args(args))

import math
import sys
from collections.abc import Sequence

from forge.config import JobConfig, load_config
from forge.config.distributed import PipelineSchedule
from forge.console import console_may_close
from forge.errors import UserInputError, print_errors
from forge.interrupts import exits_on_interrupt
from forge.metrics.flops import flops_per_token, non_embedding_parameters
from forge.parallel.bubble import bubble_fraction
from forge.parallel.memory_plan import (
    GIB,
    HEADROOM,
    MemoryPlan,
    memory_plan,
    stage_parameters,
)
from forge.parallel.stages import SINGLE_STAGE, V_SHAPED, splits_backward
from forge.parallel.world import parallel_problems, resolve_dims
from forge.training.setup.vlm import vision_footprint
from forge.types import ExitCode

MAX_NPROC = 2**31 - 1  # a torch.distributed rank is a 32-bit int
MAX_GPU_MEMORY_GB = 1 << 20  # 1 PiB per device: anything larger is a typo


def option_problems(args: argparse.Namespace) -> list[str]:
    """Out-of-range numeric options (NaN and infinity included), one line each."""
    problems = []
    if not 1 <= args.nproc <= MAX_NPROC:
        problems.append(
            f"--nproc: must be in [1, {MAX_NPROC}] (ranks in the job), got {args.nproc}"
        )
    memory = args.gpu_memory_gb
    if not (math.isfinite(memory) and 0 < memory <= MAX_GPU_MEMORY_GB):
        problems.append(
            f"--gpu-memory-gb: must be a finite number in (0, {MAX_GPU_MEMORY_GB}] (GiB per "
            f"device), got {memory}"
        )
    return problems


def report(plan: MemoryPlan, device_gb: float) -> list[str]:
    """The memory lines of the plan, in GiB."""
    rows = [
        ("weights", plan.parameters),
        ("gradients", plan.gradients),
        ("optimizer state", plan.optimizer_state),
        ("optimizer step temporaries", plan.optimizer_step),
        ("gathered weights (FSDP)", plan.gathered_weights),
        ("activations", plan.activations),
        ("loss", plan.loss),
        ("RoPE tables", plan.buffers),
        *([("FP8 casts", plan.float8_casts)] if plan.float8_casts else []),
    ]
    lines = [f"  {name:26s} {size / GIB:9.2f} GiB" for name, size in rows]
    lines.append(f"  {'total':26s} {plan.total / GIB:9.2f} GiB")
    no_ac = plan.activations_without_ac / GIB
    lines.append(f"  (activations without activation checkpointing: {no_ac:.2f} GiB)")
    if plan.snapshot:
        host = plan.snapshot / GIB
        lines.append(f"  (and in host memory, the rollback snapshot: {host:.2f} GiB)")
    usable = (1 - HEADROOM) * device_gb
    verdict = "fits" if plan.fits(device_gb * GIB) else "does NOT fit"
    lines.append(
        f"{verdict} in {device_gb:g} GiB per device ({usable:.1f} GiB usable, "
        f"{plan.total / GIB / usable:.0%} of it)"
    )
    return lines


def pipeline_lines(config: JobConfig, pp: int, sharded: bool = False) -> list[str]:
    """Under ``pp > 1``: the stages, and the bubble of every schedule at the config's
    micro-batches and stages per rank (``forge/parallel/bubble.py``'s model), the
    configured one first; those refused under FSDP2 (``sharded``) marked."""
    if pp <= 1:
        return []
    d, m = config.distributed, config.train.grad_accum_steps
    chosen = d.pp_schedule
    lines = [
        f"pipeline: {pp * d.pp_stages_per_rank} stages ({d.pp_stages_per_rank} per rank), "
        f"{m} micro-batches per step; bubble (idle share of a rank's step, F = B = W):"
    ]
    for schedule in sorted(PipelineSchedule, key=lambda s: s is not chosen):
        v = 2 if schedule in V_SHAPED else 1 if schedule in SINGLE_STAGE else d.pp_stages_per_rank
        mark = "  <- distributed.pp_schedule" if schedule is chosen else ""
        if sharded and splits_backward(pp, schedule):
            mark = "  (refused under FSDP2: data or context parallelism)"
        share = bubble_fraction(schedule, pp, v, m)
        lines.append(f"  {schedule.value:24s} {share:6.1%} at {v} stage(s) per rank{mark}")
    return lines


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    try:
        problems = option_problems(args)
        if problems:
            raise UserInputError(problems)
        if not rest or rest[0].startswith("--"):  # load_config's words name train.py
            raise UserInputError(
                "missing config file: usage: plan.py CONFIG.toml [--nproc N] "
                "[--section.key=value ...] (--help lists plan.py's own options)"
            )
        config = load_config(rest).config
        problems = [f"{k}: {m}" for k, m in parallel_problems(config, args.nproc)]
        if problems:
            raise UserInputError(problems)
    except UserInputError as exc:
        print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    m, t = config.model, config.train
    dims = resolve_dims(config.distributed, args.nproc)
    vision = vision_footprint(m)
    total = non_embedding_parameters(m) + (0 if m.tie_embeddings else m.vocab_size * m.dim)
    total += vision.parameters
    print(
        f"parameters: {total:,} total, {non_embedding_parameters(m):,} non-embedding in the decoder"
    )
    if m.vlm is not None:
        print(
            f"vision-language: {vision.parameters:,} in the encoder, adapter and cross-attention "
            f"layers; {vision.decoder_tokens} image tokens per row in the decoder"
        )
    if m.moe:
        active = non_embedding_parameters(m, active=True)
        print(f"mixture of experts: {active:,} non-embedding parameters active per token")
    print(
        f"FLOPs per token: {flops_per_token(m, t.seq_len) / 1e9:.2f} GFLOP at seq_len {t.seq_len}"
    )
    stage = stage_parameters(config, dims.pp, vision)[0]
    print(
        f"layout at {args.nproc} ranks: dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} "
        f"tp={dims.tp} pp={dims.pp} cp={dims.cp}; largest stage {stage:,} params"
    )
    print(
        f"per rank: micro-batch {t.batch_size} x {t.seq_len}, {t.mixed_precision.value} compute, "
        f"{t.param_dtype.value} weights, {config.optimizer.name.value}, "
        f"activation checkpointing {t.activation_checkpointing.value}"
    )
    for line in pipeline_lines(config, dims.pp, dims.dp * dims.cp > 1):
        print(line)
    for line in report(memory_plan(config, dims, vision), args.gpu_memory_gb):
        print(line)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
