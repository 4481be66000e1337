"""The clock of one launch's goodput ledger (``forge.metrics.goodput``): the loop's inputs and
effects wrapped so that each second lands in the bucket it was spent in, and rank 0's running
totals appended to ``<run.dir>/goodput.jsonl`` at each logged step and at the end.

The loop itself is not touched: its batches, its step, its poll and its ``Effects`` are
wrapped (``LedgerEffects`` has the loop's ``Effects`` methods), so the reducer stays pure.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from forge.jsonl import open_lines
from forge.metrics.goodput import (
    LEDGER_FILE,
    Bucket,
    LaunchRecord,
    launch_id,
    launch_line,
    ledger_metrics,
    read_ledger,
    run_totals,
)
from forge.training.loop.loop import Effects
from forge.training.loop.plan import SaveReason
from forge.types import LoopState, Signals, StepResult

BatchT = TypeVar("BatchT")


def process_started() -> float:
    """When this process started (unix time), its imports included: its age read from
    ``/proc`` (ticks since boot, against the boot clock, so no rounding of the boot time
    enters), else now."""
    try:
        ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()
    return time.time() - max(0.0, age)


class LaunchClock:
    """This launch's seconds by bucket; rank 0 appends them to the run's ledger."""

    def __init__(
        self,
        run_dir: pathlib.Path,
        is_main: bool,
        started: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = run_dir / LEDGER_FILE
        self.is_main = is_main
        self.started = started
        self.clock = clock
        self.launch = launch_id(started, os.getpid())
        self.seconds = dict.fromkeys(Bucket, 0.0)
        self.step = 0
        # (step, productive seconds) of the steps no committed checkpoint holds yet: what a
        # death loses (a save that fails or is still in flight commits none of them)
        self.unsaved: list[tuple[int, float]] = []
        # the last step a save or a snapshot was taken at: a commit or a rollback splits the
        # unsaved steps there only, so the steps past it are one entry (bounded by saves and
        # snapshots, not by steps: a run without checkpoints trains for days)
        self.boundary = -1
        self.since_snapshot = 0.0  # productive seconds a rollback would train again
        self.last_step: tuple[Bucket, float] | None = None
        self.earlier = read_ledger(self.path) if is_main else []  # the run's other launches
        self.replicated = False  # a replica group's launch: a death loses no step
        self.unwritable = False  # the ledger refused a line: said once, not at every step
        self.completed = False  # the launch ends with the run complete

    def started_up(self, entered: float, load_s: float, verify_s: float) -> None:
        """Before the loop: the imports (process start to ``main``, at ``entered``), the
        checkpoint's load and its verification."""
        self.add(Bucket.IMPORTS, entered - self.started)
        self.add(Bucket.LOAD, load_s - verify_s)
        self.add(Bucket.VERIFY, verify_s)

    def loop_begins(self, step: int, steps_left: bool = True) -> None:
        """Set-up is the rest of the time before the loop (config, process group, model,
        data, guards); written at once where the loop has steps to run (``steps_left``), so
        a launch killed before its first logged step still counts as one, its start-up in
        its buckets. A launch that finds the run complete writes nothing."""
        self.step = step
        before = sum(self.seconds[b] for b in (Bucket.IMPORTS, Bucket.LOAD, Bucket.VERIFY))
        self.add(Bucket.SETUP, self.clock() - self.started - before)
        if steps_left:
            self.write()

    def add(self, bucket: Bucket, seconds: float) -> None:
        self.seconds[bucket] += seconds

    @contextlib.contextmanager
    def timing(self, bucket: Bucket) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(bucket, self.clock() - start)

    @property
    def uncommitted(self) -> float:
        """Productive seconds no committed checkpoint holds (lost if the launch died now)."""
        return sum(seconds for _, seconds in self.unsaved)

    def step_done(self, result: StepResult, seconds: float, step: int) -> None:
        """Step ``step``'s seconds: productive, dropped (not applied) or a hang (its
        collectives failed: the time until that was detected)."""
        if result.collective_failed:
            bucket = Bucket.HANG
        elif not (result.finite and result.applied):
            bucket = Bucket.DROPPED
        else:
            bucket = Bucket.PRODUCTIVE
            if self.unsaved and self.unsaved[-1][0] > self.boundary:
                self.unsaved[-1] = (step, self.unsaved[-1][1] + seconds)
            else:
                self.unsaved.append((step, seconds))
            self.since_snapshot += seconds
        self.add(bucket, seconds)
        self.last_step = (bucket, seconds)

    def dropped_elsewhere(self) -> None:
        """A peer's step was not finite: this rank's step was dropped too."""
        if self.last_step is not None and self.last_step[0] is Bucket.PRODUCTIVE:
            seconds = self.last_step[1]
            self.move(Bucket.PRODUCTIVE, Bucket.DROPPED, seconds)
            step, total = self.unsaved.pop()
            if total - seconds > 0:  # the earlier steps of the same entry stay unsaved
                self.unsaved.append((step - 1, total - seconds))
            self.since_snapshot -= seconds
            self.last_step = (Bucket.DROPPED, seconds)

    def committed(self, step: int | None) -> bool:
        """A checkpoint of ``step`` is committed (None: none known): the steps up to it are
        no longer lost with the launch. Whether that changed what a death would lose."""
        kept = [(s, seconds) for s, seconds in self.unsaved if step is None or s > step]
        changed, self.unsaved = len(kept) != len(self.unsaved), kept
        return changed

    def rolled_back(self, step: int) -> None:
        """A rollback to ``step``: the productive seconds since its snapshot are recomputed,
        and the steps after it are trained again (their seconds counted once, then)."""
        self.move(Bucket.PRODUCTIVE, Bucket.RECOMPUTED, self.since_snapshot)
        self.since_snapshot = 0.0
        self.unsaved = [(s, seconds) for s, seconds in self.unsaved if s <= step]

    def move(self, source: Bucket, target: Bucket, seconds: float) -> None:
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def record(self, ended: bool) -> LaunchRecord:
        return LaunchRecord(
            launch=self.launch,
            started=self.started,
            wall=round(self.clock() - self.started, 3),
            step=self.step,
            uncommitted=round(self.uncommitted, 3),
            ended=ended,
            seconds={b.value: round(s, 3) for b, s in self.seconds.items() if s},
            replicated=self.replicated,
            completed=self.completed,
        )

    def run_metrics(self) -> dict[str, float]:
        """The run's ledger so far, this launch still running (for its logged records)."""
        return ledger_metrics(run_totals(self.earlier, self.record(ended=False)))

    def write(self, ended: bool = False) -> None:
        """Append this launch's totals (rank 0); a disk that cannot take them loses this line
        only (the ledger is a record, never the reason a run stops: said once a launch)."""
        if not self.is_main:
            return
        try:
            with open_lines(self.path) as f:
                f.write(launch_line(self.record(ended)))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if not self.unwritable:
                print(
                    f"[forge] warning: goodput ledger {self.path}: {exc}; the run goes on, "
                    "its lines lost until it takes them again",
                    file=sys.stderr,
                )
            self.unwritable = True

    def launches(self) -> list[LaunchRecord]:
        """The run's launches as this one ends: the others' last lines (read at its start)
        and its own, from memory (whether or not the disk took it)."""
        return [*self.earlier, self.record(ended=True)]


def timed_batches(batches: Iterator[BatchT], clock: LaunchClock) -> Iterator[BatchT]:
    """``batches``, the wait for each in the loader bucket."""
    while True:
        with clock.timing(Bucket.LOADER):
            try:
                batch = next(batches)
            except StopIteration:
                return
        yield batch


def timed_step(
    step: Callable[[BatchT, LoopState], StepResult], clock: LaunchClock
) -> Callable[[BatchT, LoopState], StepResult]:
    """``step``, its seconds in the bucket its result says (``LaunchClock.step_done``)."""

    def timed(batch: BatchT, state: LoopState) -> StepResult:
        start = clock.clock()
        result = step(batch, state)
        clock.step_done(result, clock.clock() - start, state.step + 1)
        return result

    return timed


def timed_poll(
    poll: Callable[[StepResult], Signals], clock: LaunchClock
) -> Callable[[StepResult], Signals]:
    """``poll`` (the control word), in the logging bucket — or, when it found a peer stalled
    or dead, in the hang bucket (its wait was the time to detect that); a peer's non-finite
    step makes this rank's step a dropped one."""

    def timed(result: StepResult) -> Signals:
        start = clock.clock()
        signals = poll(result)
        clock.add(Bucket.HANG if signals.health_failed else Bucket.LOGGING, clock.clock() - start)
        if signals.nonfinite:
            clock.dropped_elsewhere()
        return signals

    return timed


class LedgerEffects:
    """The loop's ``Effects``, each timed into its bucket; the ledger line is written after
    each logged step."""

    def __init__(
        self,
        effects: Effects,
        clock: LaunchClock,
        carry: Callable[[dict[str, Any]], None] = lambda record: None,
        committed: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.effects = effects
        self.clock = clock
        self.carry = carry  # values for the next logged record: the run's goodput so far
        self.committed = committed  # the newest committed checkpoint's step (None: none)

    def save(self, state: LoopState, reason: SaveReason) -> None:
        with self.clock.timing(Bucket.CHECKPOINT):
            self.effects.save(state, reason)
        self.clock.boundary = state.step  # a later commit of it splits the unsaved steps here
        self.settle()

    def wait(self) -> None:
        with self.clock.timing(Bucket.CHECKPOINT):
            self.effects.wait()
        self.settle()

    def settle(self) -> None:
        """After a save or its wait: what a commit took out of the lost work, written at
        once (a kill between a commit and the next logged step must not count the steps it
        holds as lost)."""
        if self.clock.committed(self.committed()):
            self.clock.write()

    def log(self, state: LoopState, result: StepResult) -> None:
        with self.clock.timing(Bucket.LOGGING):
            if self.clock.is_main:
                self.carry(self.clock.run_metrics())
            self.effects.log(state, result)
            self.clock.step = state.step
            self.clock.write()

    def evaluate(self, state: LoopState) -> None:
        with self.clock.timing(Bucket.EVALUATION):
            self.effects.evaluate(state)

    def step_end(self, state: LoopState, result: StepResult) -> None:
        self.clock.step = state.step
        with self.clock.timing(Bucket.LOGGING):
            self.effects.step_end(state, result)

    def snapshot(self, state: LoopState) -> None:
        with self.clock.timing(Bucket.CHECKPOINT):
            self.effects.snapshot(state)
        self.clock.since_snapshot = 0.0
        self.clock.boundary = state.step  # a rollback to it splits the unsaved steps here

    def restore(self, state: LoopState) -> None:
        """A rollback: the steps since the snapshot are trained again."""
        self.clock.rolled_back(state.step)
        with self.clock.timing(Bucket.RECOMPUTED):
            self.effects.restore(state)

    def __getattr__(self, name: str) -> Any:  # what the loop does not call passes through
        return getattr(self.effects, name)
