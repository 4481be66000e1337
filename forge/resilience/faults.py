"""Fault injection, for tests only: a non-finite loss, a signal, a stall, a corrupted
gradient, a slow rank or a loss spike at step k on rank r.

Set ``FORGE_FAULTS`` (test-only; never in production) to a comma-separated list of
``kind:step=K[:rank=R][:key=value...]``:

- ``nan:step=3:rank=1`` — the model's outputs in step 3 on rank 1 are multiplied by NaN, and
  so its loss and gradients (``with_faults``, composed around the step by the driver);
- ``signal:step=5:rank=0:sig=TERM`` — rank 0 sends itself SIGTERM after step 5;
- ``stall:step=4:rank=1:seconds=30`` — rank 1 sleeps 30 s after step 4; with
  ``until=PATH``, until a file appears at PATH (at most ``seconds``): a test holds the rank
  there until an event it waits for has happened elsewhere;
- ``corrupt:step=3:rank=1[:times=N]`` — one bit of one gradient element flips on rank 1 in
  each of the first N computations of step 3 (default 1), a different element each time
  (``GradientFaults``: a replayed step outvotes one, not three); with ``sticky=1`` the same
  element each time, a persistent fault that only a comparison with replicas can see;
- ``slow:step=1:rank=1:seconds=0.4`` — rank 1 computes 0.4 s longer in every step from step 1
  on (it keeps busy, as a slow device does: a sleeping rank would look like one waiting);
- ``spike:step=15[:rank=R]:scale=1000`` — the loss and the gradients of step 15 are
  multiplied by 1000 (every computation of it).

``step`` counts completed steps (1 is the first). Without ``rank`` the fault hits every rank.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from forge.model.transformer import is_moe, split_moe_output
from forge.types import Hooks, LoopState, StepResult

BatchT = TypeVar("BatchT")

ENV = "FORGE_FAULTS"


class FaultKind(enum.Enum):
    NAN = "nan"
    SIGNAL = "signal"
    STALL = "stall"
    CORRUPT = "corrupt"
    SLOW = "slow"
    SLOW_DATA = "slow_data"
    SPIKE = "spike"


IN_COMPUTATION = (FaultKind.CORRUPT, FaultKind.SPIKE)  # ``GradientFaults``'
# each gradient dtype's bits as an integer type, and its highest mantissa bit
MANTISSA_TOP = {
    torch.float64: (torch.int64, 1 << 51),
    torch.float32: (torch.int32, 1 << 22),
    torch.bfloat16: (torch.int16, 1 << 6),
    torch.float16: (torch.int16, 1 << 9),
}


@attrs.frozen
class Fault:
    kind: FaultKind
    step: int
    rank: int | None = None
    sig: str = "TERM"
    seconds: float = 30.0
    times: int = 1
    scale: float = 1.0
    sticky: bool = False  # corrupt: the same element each time (a persistent fault)
    until: str = ""  # stall: until a file appears at this path (at most ``seconds``)

    def hits(self, step: int, rank: int) -> bool:
        return self.step == step and self.on(rank)

    def on(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse ``FORGE_FAULTS``; a malformed entry is a ``ValueError`` naming it."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        kind, *pairs = entry.split(":")
        try:
            fields = dict(p.split("=", 1) for p in pairs)
            faults.append(
                Fault(
                    kind=FaultKind(kind),
                    step=int(fields.pop("step")),
                    rank=int(fields.pop("rank")) if "rank" in fields else None,
                    sig=fields.pop("sig", "TERM"),
                    seconds=float(fields.pop("seconds", "30")),
                    times=int(fields.pop("times", "1")),
                    scale=float(fields.pop("scale", "1")),
                    sticky=bool(int(fields.pop("sticky", "0"))),
                    until=fields.pop("until", ""),
                )
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{ENV}: cannot parse {entry!r} ({exc})") from None
        if fields:
            raise ValueError(f"{ENV}: unknown keys {sorted(fields)} in {entry!r}")
    return tuple(faults)


def faults_from_env(env: Mapping[str, str]) -> tuple[Fault, ...]:
    return parse_faults(env.get(ENV, ""))


class NanInjector:
    """Output multipliers by step: NaN once for each ``nan`` fault that hits this rank, 1.0
    otherwise. One-shot, so a rolled-back step number does not fail again."""

    def __init__(self, faults: tuple[Fault, ...], rank: int) -> None:
        self.pending = [f for f in faults if f.kind is FaultKind.NAN]
        self.rank = rank

    def __call__(self, step: int) -> float:
        """The multiplier for the step that will complete as ``step`` (1-based)."""
        for f in self.pending:
            if f.hits(step, self.rank):
                self.pending.remove(f)
                return float("nan")
        return 1.0


def with_faults(
    step_fn: Callable[[BatchT, LoopState], StepResult],
    model: nn.Module,
    faults: tuple[Fault, ...],
    rank: int,
) -> Callable[[BatchT, LoopState], StepResult]:
    """``step_fn`` itself when no ``nan`` or ``slow`` fault hits this rank; else a step that,
    on each ``nan`` step, runs ``step_fn`` with the model's outputs multiplied by NaN (a
    forward hook for that step only: its loss and gradients are NaN, as in a diverged step),
    and from a ``slow`` fault's step on first keeps busy for its seconds."""
    injector = NanInjector(faults, rank)
    slow = [f for f in faults if f.kind is FaultKind.SLOW and f.on(rank)]
    if not slow and not any(f.on(rank) for f in injector.pending):
        return step_fn
    moe = is_moe(model)

    def poison(_module: nn.Module, _inputs: Any, output: Any) -> Any:
        out, stats = split_moe_output(output, moe)  # routing statistics stay as they are
        out = times_nan(out)
        if stats is None:
            return out
        return (*out, stats) if isinstance(out, tuple) else (out, stats)

    def faulty_step(batches: BatchT, state: LoopState) -> StepResult:
        for f in slow:
            if state.step + 1 >= f.step:
                keep_busy(f.seconds)
        if injector(state.step + 1) == 1.0:
            return step_fn(batches, state)
        handle = model.register_forward_hook(poison)
        try:
            return step_fn(batches, state)
        finally:
            handle.remove()

    return faulty_step


def with_slow_data(
    batches: Iterator[BatchT], faults: tuple[Fault, ...], rank: int, first_step: int
) -> Iterator[BatchT]:
    """``batches``, each from a ``slow_data`` fault's step on (the first is ``first_step``'s)
    handed over ``seconds`` late: the rank sleeps, as one waiting on a slow disk does."""
    slow = [f for f in faults if f.kind is FaultKind.SLOW_DATA and f.on(rank)]
    if not slow:
        return batches

    def late() -> Iterator[BatchT]:
        for step, batch in enumerate(batches, first_step):
            time.sleep(sum(f.seconds for f in slow if step >= f.step))
            yield batch

    return late()


def keep_busy(seconds: float) -> None:
    """Spend ``seconds`` computing (not sleeping: the process's CPU time counts it)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class GradientFaults:
    """The ``corrupt`` and ``spike`` faults of this rank, as the step's ``GradientFault``.
    Each hits one run of its step: a step number run again after a rollback runs clean."""

    def __init__(self, faults: tuple[Fault, ...], rank: int) -> None:
        self.faults = [f for f in faults if f.kind in IN_COMPUTATION and f.on(rank)]
        self.runs = [0] * len(self.faults)  # how often each fault's step began

    def __call__(
        self, step: int, computation: int, params: Sequence[torch.Tensor], loss: torch.Tensor
    ) -> torch.Tensor:
        for i, f in enumerate(self.faults):
            if f.step != step:
                continue
            self.runs[i] += computation == 0
            if self.runs[i] > 1:  # the step again, after a rollback
                continue
            if f.kind is FaultKind.SPIKE:
                loss = loss * f.scale
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(f.scale)
            elif computation < f.times:
                flip_bit(params, 0 if f.sticky else computation)
        return loss


def gradient_faults(faults: tuple[Fault, ...], rank: int) -> GradientFaults | None:
    """The step's ``GradientFault`` on this rank, or None when no such fault hits it."""
    hits = GradientFaults(faults, rank)
    return hits if hits.faults else None


def flip_bit(params: Sequence[torch.Tensor], element: int) -> None:
    """Flip the highest mantissa bit of the ``element``-th non-zero gradient element of the
    first parameter that has more than three: its value changes by up to a half, and stays
    finite (a zero's flip would be a subnormal no update could feel)."""
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        nonzero = local.reshape(-1).nonzero().flatten()
        if nonzero.numel() <= 3:
            continue
        width, bit = MANTISSA_TOP[local.dtype]
        flat = local.view(-1).view(width)
        flat[nonzero[element]] ^= bit
        return


def times_nan(value: Any) -> Any:
    """Every floating-point tensor in ``value`` (a tensor, or a tuple of them and None)
    multiplied by NaN."""
    if isinstance(value, tuple):
        return tuple(times_nan(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value * float("nan")
    return value


class FaultHooks(Hooks):
    """Delivers ``signal`` and ``stall`` faults at the end of their step."""

    def __init__(self, faults: tuple[Fault, ...], rank: int) -> None:
        self.faults = [f for f in faults if f.kind in (FaultKind.SIGNAL, FaultKind.STALL)]
        self.rank = rank

    def on_step_end(self, state: LoopState, result: StepResult) -> None:
        for f in list(self.faults):
            if not f.hits(state.step, self.rank):
                continue
            self.faults.remove(f)  # one-shot
            if f.kind is FaultKind.SIGNAL:
                os.kill(os.getpid(), getattr(signal, f"SIG{f.sig}"))
            elif f.kind is FaultKind.STALL:
                stall(f)


def stall(fault: Fault) -> None:
    """Sleep ``fault.seconds``, or until a file appears at ``fault.until`` (at most as long)."""
    if not fault.until:
        time.sleep(fault.seconds)
        return
    end = time.monotonic() + fault.seconds
    while not os.path.exists(fault.until):
        if time.monotonic() >= end:  # said: what the test held the rank for did not happen
            print(f"{ENV}: stall until {fault.until}: not there after {fault.seconds:g} s; "
                  "going on", file=sys.stderr, flush=True)  # fmt: skip
            return
        time.sleep(0.05)
