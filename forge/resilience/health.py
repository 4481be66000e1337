"""Turning a failed or timed-out collective inside a step into a health failure, not a crash.

A stalled or dead peer makes the next collective time out (``distributed.timeout_s``) or fail
with a closed connection. gloo raises a plain ``RuntimeError`` for both, so the check looks at
the message as well as at ``torch.distributed.DistError``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from forge.resilience.stacks import StackWatch, every_rank
from forge.resilience.stalls import failed_collective, flight_recorder_trace, stall_line
from forge.types import LoopState, StepResult

_MARKERS = ("Timed out", "Connection closed by peer", "Connection reset", "gloo", "NCCL")

BatchT = TypeVar("BatchT")


def is_collective_failure(exc: BaseException) -> bool:
    """True for errors a broken process group raises (timeouts, peers gone)."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS)


def failed_step() -> StepResult:
    """What a step whose collectives failed reports: nothing trained, and unhealthy."""
    return StepResult(loss=math.nan, grad_norm=math.nan, tokens=0, lr=0.0, collective_failed=True)


def guard_collectives(
    step_fn: Callable[[BatchT, LoopState], StepResult],
    rank: int = 0,
    timeout_s: float = 0.0,
    stacks: StackWatch | None = None,
) -> Callable[[BatchT, LoopState], StepResult]:
    """``step_fn``, with a collective failure reported as ``failed_step()`` and one line
    naming this rank and the collective that never completed (``stall_line``); with
    ``stacks``, that line and this rank's stacks go to its stacks file, which the line names."""

    def guarded(batch: BatchT, state: LoopState) -> StepResult:
        try:
            return step_fn(batch, state)
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            pending = failed_collective(flight_recorder_trace())
            line = stall_line(rank, state.step + 1, pending, timeout_s, str(exc))
            if stacks is not None:
                stacks.record(line)
                line += f"; each rank's stacks: {every_rank(stacks.path.parent.parent)}"
            print(f"[forge] error: {line}", file=sys.stderr)
            return failed_step()

    return guarded
