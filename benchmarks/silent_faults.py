"""Cost of the quiet-fault checks on the debug model, against the plain step in the same run.

One process, the debug model (dim 256, 4 layers, 2 micro-batches of 4 x 256 tokens). Steps
replayed every other step (``resilience.replay_interval = 2``) and plain ones alternate, so
both see the same machine state; a replayed step's extra cost over a plain one, spread over
N steps, is the overhead of ``replay_interval = N``. The straggler clock (``timed``: two
``time.process_time`` reads around the step) is timed on its own against the step::

    python benchmarks/silent_faults.py [--steps 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from forge.cli import summary
from forge.config import ModelConfig, OptimizerConfig, Precision, SchedulerConfig
from forge.data.batch import Batch
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, resolve_schedule
from forge.resilience.stragglers import timed
from forge.training.loop.plan import ReplayRule
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step
from forge.types import LoopState, StepResult

MODEL = ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)


def batches(step: int) -> tuple[Batch, ...]:
    g = torch.Generator().manual_seed(step)
    rows = [torch.randint(0, 259, (4, 257), generator=g) for _ in range(2)]
    return tuple(Batch(inputs=r[:, :-1], labels=r[:, 1:]) for r in rows)


def step_times(steps: int) -> tuple[list[float], list[float]]:
    """Wall time of each plain and each replayed step, alternating (replayed on even steps)."""
    torch.manual_seed(0)
    model = Transformer(MODEL)
    opt = build_optimizer(model, OptimizerConfig(lr=3e-3))
    schedule = resolve_schedule(SchedulerConfig(warmup_steps=2), 1000)
    spec = StepSpec(model, opt, schedule, 3e-3, Precision.FP32, replay=ReplayRule(interval=2))
    step = make_text_step(spec)
    plain, replayed = [], []
    for k in range(steps + 2):
        data = batches(k)
        start = time.perf_counter()
        result = step(data, LoopState(step=k))
        elapsed = time.perf_counter() - start
        if k >= 2:  # the first two warm up
            (replayed if result.replay is not None else plain).append(elapsed)
    return plain, replayed


def clock_cost(calls: int = 100_000) -> float:
    """Seconds ``timed`` adds to one step (its two clock reads and the result's copy)."""
    result = StepResult(loss=1.0, grad_norm=1.0, tokens=1, lr=1.0)
    bare = lambda _b, _s: result  # noqa: E731
    wrapped = timed(bare)
    state = LoopState()
    start = time.perf_counter()
    for _ in range(calls):
        bare(None, state)
    base = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        wrapped(None, state)
    return (time.perf_counter() - start - base) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--steps", type=int, default=24, help="timed steps (half replayed)")
    args = parser.parse_args()
    plain, replayed = step_times(args.steps)
    t_plain, t_replayed = statistics.median(plain), statistics.median(replayed)
    extra = t_replayed / t_plain - 1
    print(f"threads: {torch.get_num_threads()}; {len(plain)} plain and {len(replayed)} replayed")
    print(f"plain step: {t_plain * 1e3:.0f} ms; replayed step: {t_replayed * 1e3:.0f} ms")
    print(f"ratio replayed / plain: {t_replayed / t_plain:.3f}")
    for n in (1, 10, 100):
        print(f"replay_interval = {n}: overhead {extra / n:.2%} of the plain step")
    cost = clock_cost()
    print(f"straggler clock: {cost * 1e6:.2f} us per step = {cost / t_plain:.5%} of the step")


if __name__ == "__main__":
    main()
