"""Mixture-of-experts layer throughput against a dense SwiGLU with the same active parameters.

The debug_moe shapes (dim 256; 8 routed experts of width 232, top-2, plus 1 shared: 3 × 232
active) against the dense debug model's feed-forward (width 704): forward + backward of one
layer on ``--tokens`` tokens, with grouped GEMMs (``torch._grouped_mm``; as a CPU runs them,
and with each group padded to ``--align`` rows as a GPU runs them), with the sync-free
fixed-capacity buffers (a bmm over ``E × bound`` rows) and with the per-expert loop (one matmul
per expert on its contiguous slice). Modes alternate within each round; medians of
``--rounds`` rounds of ``--steps`` steps. Prints tokens/s and the ratios::

    python benchmarks/moe.py [--tokens 2048] [--rounds 5] [--steps 10] [--dtype fp32|bf16]
        [--capacity-factor 0] [--align 8]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
from torch import nn

from forge.cli import summary
from forge.config.sections import ModelConfig
from forge.model import moe as moe_module
from forge.model.expert_groups import ExpertKernel
from forge.model.feed_forward import FeedForward
from forge.model.moe import MoE, empty_stats
from forge.training.setup.problems import cpu_flags


def step_time(run: Callable[[], torch.Tensor], steps: int) -> float:
    """Seconds per forward + backward of ``run``, over ``steps``."""
    start = time.perf_counter()
    for _ in range(steps):
        run().backward()
    return (time.perf_counter() - start) / steps


def parse() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--capacity-factor", type=float, default=0.0, help="0: dropless")
    parser.add_argument("--align", type=int, default=8, help="rows per padded group")
    return parser.parse_args()


def modes(args: argparse.Namespace, cfg: ModelConfig) -> dict[str, Callable[[], torch.Tensor]]:
    """The dense SwiGLU and the MoE layer with each expert kernel forced, as losses."""
    moe = MoE(cfg, 0)
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        nn.init.normal_(w, std=0.02)
    dense = FeedForward(cfg.dim, cfg.hidden_dim)
    x = torch.randn(args.tokens, cfg.dim, requires_grad=True)
    stats = empty_stats(cfg, "cpu")

    def autocast() -> contextlib.AbstractContextManager:
        if args.dtype == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def run_dense() -> torch.Tensor:
        with autocast():
            return dense(x).float().square().mean()

    def forced(kernel: ExpertKernel, align: int = 1) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with (
                mock.patch.object(moe_module, "expert_kernel", lambda *_: kernel),
                mock.patch.object(moe_module, "group_alignment", lambda *_: align),
                autocast(),
            ):
                out, _ = moe(x, stats)
            return out.float().square().mean()

        return run

    return {
        "dense": run_dense,
        "moe grouped": forced(ExpertKernel.GROUPED),
        "moe padded": forced(ExpertKernel.GROUPED, args.align),
        "moe buffered": forced(ExpertKernel.BUFFERED),
        "moe loop": forced(ExpertKernel.LOOP),
    }


def main() -> None:
    """Time every mode, rounds rotating their order; print tokens/s and the ratios."""
    args = parse()
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=256,
        n_heads=4,
        moe_num_experts=8,
        moe_top_k=2,
        moe_shared_experts=1,
        moe_hidden_dim=232,
        moe_capacity_factor=args.capacity_factor,
    )
    runs = modes(args, cfg)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        step_time(run, 2)  # warm-up
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            times[name].append(step_time(runs[name], args.steps))
    bf16_native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    print(f"CPU: {torch.get_num_threads()} threads, avx512_bf16/amx: {bf16_native}")
    print(
        f"{args.tokens} tokens, dim {cfg.dim}, {args.dtype}; MoE: {cfg.moe_num_experts} experts "
        f"x {cfg.expert_hidden_dim} wide, top-{cfg.moe_top_k} + {cfg.moe_shared_experts} "
        f"shared, capacity factor {args.capacity_factor}; dense: {cfg.hidden_dim} wide "
        f"(same active parameters); padded groups: {args.align} rows"
    )
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, t in median.items():
        print(f"{name:13s}{args.tokens / t:10,.0f} tokens/s  ({t * 1e3:.2f} ms per fwd+bwd)")
    print(f"ratio moe grouped / dense: {median['dense'] / median['moe grouped']:.2f}")
    print(f"ratio moe loop / dense:    {median['dense'] / median['moe loop']:.2f}")
    print(f"ratio grouped / loop:      {median['moe loop'] / median['moe grouped']:.2f}")
    print(f"ratio padded / grouped:    {median['moe grouped'] / median['moe padded']:.2f}")
    print(f"ratio buffered / loop:     {median['moe loop'] / median['moe buffered']:.2f}")


if __name__ == "__main__":
    main()
