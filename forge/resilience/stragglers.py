"""Stragglers: each rank's own time per step, compared across ranks at every log.

A rank's own time is the CPU time its process spent in the step (``time.process_time``, every
thread: the compute threads included), plus the wall time it waited for its own next batch
(``LoaderWaits``: a slow disk or data pipeline on one host, which its peers wait for at the
step's first collective while their CPU clocks stand still). A rank waiting for its peers in
a collective blocks without spending any, so one slow rank shows as the one with the most,
while every rank's wall-clock time per step is the same. The times travel in the log step's
one reduction (a per-rank gather, ``forge.metrics.reduction``); the decisions below are pure
and table-tested.

Not seen: a rank that is descheduled inside its step (CPU steal, cgroup throttling, a stop
signal) spends neither CPU time nor loader wait. On CUDA the host's CPU time measures the
host's side of the step (data, Python, launches), not the device's compute: a slow GPU is not
seen by it (``docs/resilience.md``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import attrs

from forge.types import LoopState, StepResult

BatchT = TypeVar("BatchT")


@attrs.define
class LoaderWaits:
    """The wall time this rank waited for its own batches since its last step reported it."""

    clock: Callable[[], float] = time.perf_counter
    pending: float = 0.0

    def watch(self, batches: Iterator[BatchT]) -> Iterator[BatchT]:
        """``batches``, the wait for each kept until ``take``."""
        while True:
            start = self.clock()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.pending += self.clock() - start
            yield batch

    def take(self) -> float:
        """The wait kept since the last call."""
        waited, self.pending = self.pending, 0.0
        return waited


def timed(
    step_fn: Callable[[BatchT, LoopState], StepResult],
    clock: Callable[[], float] = time.process_time,
    waits: LoaderWaits | None = None,
) -> Callable[[BatchT, LoopState], StepResult]:
    """``step_fn`` reporting its own time (``StepResult.busy_s``): its time by ``clock``, and
    the rank's wait for the step's batch when ``waits`` kept it."""

    def timed_step(batches: BatchT, state: LoopState) -> StepResult:
        start = clock()
        result = step_fn(batches, state)
        waited = waits.take() if waits is not None else 0.0
        return attrs.evolve(result, busy_s=clock() - start + waited)

    return timed_step


@attrs.frozen
class StragglerReading:
    """The slowest rank at one log, and its time over the median rank's."""

    slowest_rank: int
    ratio: float


def straggler_reading(busy: Sequence[float]) -> StragglerReading:
    """The reading of every rank's own time per step (in rank order). Ties name the lowest
    rank; a median of zero (no rank measured anything) reads 1.0."""
    slowest = max(range(len(busy)), key=lambda r: (busy[r], -r))
    median = statistics.median(busy)
    ratio = busy[slowest] / median if median > 0 else 1.0
    return StragglerReading(slowest, ratio)


@attrs.frozen
class StragglerStreak:
    """The rank slow at the last logs, and at how many in a row."""

    rank: int = -1
    logs: int = 0


def next_streak(
    streak: StragglerStreak, reading: StragglerReading, threshold: float
) -> StragglerStreak:
    """The streak after one more log: it grows while the same rank stays above
    ``threshold``, starts over when another rank is, and ends when none is."""
    if reading.ratio <= threshold:
        return StragglerStreak()
    if reading.slowest_rank != streak.rank:
        return StragglerStreak(reading.slowest_rank, 1)
    return StragglerStreak(streak.rank, streak.logs + 1)


def warns(streak: StragglerStreak, logs: int) -> bool:
    """Whether this log is the one to warn at: the streak just reached ``logs`` (once per
    streak, however long it lasts)."""
    return streak.logs == logs


def straggler_line(reading: StragglerReading, host: str, logs: int) -> str:
    """The warning naming a straggler."""
    return (
        f"rank {reading.slowest_rank} (host {host}) is a straggler: its own time per step has "
        f"been {reading.ratio:.2f}x the median rank's for {logs} logged steps in a row, and "
        "every rank waits for it; check that host (thermal throttling, a shared device, a "
        "slow disk or data pipeline)"
    )
