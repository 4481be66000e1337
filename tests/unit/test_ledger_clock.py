"""The ledger's clock of one launch (``forge.training.loop.ledger``): which productive seconds a
death would lose. Only a committed checkpoint holds a step: a save that fails or is still in
flight holds none, and a commit is written to the ledger at once (a kill right after it must
not count the steps it holds as lost)."""

from __future__ import annotations

import pytest

from forge.metrics.goodput import Bucket, read_ledger
from forge.training.loop.ledger import LaunchClock, LedgerEffects, timed_poll
from forge.training.loop.plan import SaveReason
from forge.types import LoopState, Signals, StepResult

OK = StepResult(loss=1.0, grad_norm=1.0, tokens=1, lr=0.1)


class Saves:
    """The loop's effects as far as the ledger sees them: a save commits at once (sync), at
    the next wait (async), or never (it failed)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.newest: int | None = None  # the newest committed step
        self.in_flight: int | None = None

    def save(self, state: LoopState, reason: SaveReason) -> None:
        if self.mode == "sync":
            self.newest = state.step
        elif self.mode == "async":
            self.in_flight = state.step

    def wait(self) -> None:
        if self.in_flight is not None:
            self.newest, self.in_flight = self.in_flight, None

    def log(self, state, result) -> None: ...
    def evaluate(self, state) -> None: ...
    def step_end(self, state, result) -> None: ...
    def snapshot(self, state) -> None: ...
    def restore(self, state) -> None: ...


def trained(tmp_path, mode: str, script: str):
    """A launch driven by ``script``: ``s`` a 1-second productive step, ``S`` a save of the
    step reached (as ``mode`` says), ``F`` a save that fails, ``W`` the save's wait, ``L`` a
    logged step, ``P`` a snapshot, ``R`` a rollback to the last snapshot."""
    now = [0.0]
    clock = LaunchClock(tmp_path, True, 0.0, clock=lambda: now[0])
    saves = Saves(mode)
    effects = LedgerEffects(saves, clock, committed=lambda: saves.newest)  # type: ignore[arg-type]
    step, snapshot = 0, 0
    for op in script:
        state = LoopState(step=step)
        if op == "s":
            now[0] += 1.0
            clock.step_done(OK, 1.0, step + 1)
            step += 1
        elif op in "SF":
            saves.mode = "failed" if op == "F" else mode
            effects.save(state, SaveReason.SCHEDULED)
        elif op == "W":
            effects.wait()
        elif op == "L":
            effects.log(state, OK)
        elif op == "P":
            effects.snapshot(state)
            snapshot = step
        elif op == "R":
            effects.restore(LoopState(step=snapshot))
            step = snapshot
    return clock


# (case, save mode, the launch, seconds a death now loses, seconds its last line says it loses)
ROWS = [
    ("no save: every step", "sync", "ssss" + "L", 4.0, 4.0),
    ("a commit holds its steps", "sync", "ssss" + "S" + "ss", 2.0, 0.0),
    ("a commit right after a logged step is written at once", "sync", "ssss" + "L" + "S" + "s", 1.0, 0.0),
    ("a save in flight holds none", "async", "ssss" + "S" + "ss" + "L", 6.0, 6.0),
    ("an async save holds its steps once it commits", "async", "ssss" + "S" + "ss" + "W", 2.0, 2.0),
    ("a failed save holds none", "failed", "ssss" + "S" + "ss" + "L", 6.0, 6.0),
    ("a failed save after a commit: the commit still holds", "sync", "ss" + "S" + "ss" + "F" + "s", 3.0, 0.0),
    ("a rollback: the steps since the snapshot come again", "sync", "ss" + "P" + "sss" + "R" + "s" + "L", 3.0, 3.0),
]  # fmt: skip


@pytest.mark.parametrize(
    "mode,script,lost,written", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_what_a_death_would_lose(tmp_path, mode, script, lost, written):
    clock = trained(tmp_path, mode, script)
    assert clock.uncommitted == pytest.approx(lost)
    (line,) = read_ledger(tmp_path / "goodput.jsonl", now=1e9)
    assert line.uncommitted == pytest.approx(written)


def test_a_rollback_moves_the_snapshot_s_steps_to_recomputed_and_counts_the_redone_ones_once(
    tmp_path,
):
    clock = trained(tmp_path, "sync", "ss" + "P" + "sss" + "R" + "sss")
    assert clock.seconds[Bucket.RECOMPUTED] == pytest.approx(3.0)
    assert clock.seconds[Bucket.PRODUCTIVE] == pytest.approx(5.0)
    assert clock.uncommitted == pytest.approx(5.0)  # steps 1-5 as trained last, no commit


def test_a_launch_is_in_the_ledger_from_its_loop_s_start(tmp_path):
    """Killed before its first logged step, a launch still counts as one, its start-up in
    its buckets (not all of it down time); one that finds the run complete writes nothing."""
    for steps_left in (False, True):
        clock = LaunchClock(tmp_path, True, 0.0, clock=lambda: 7.0)
        clock.started_up(entered=3.0, load_s=1.0, verify_s=0.5)
        clock.loop_begins(step=10, steps_left=steps_left)
        assert (tmp_path / "goodput.jsonl").exists() is steps_left
    (line,) = read_ledger(tmp_path / "goodput.jsonl", now=1e9)
    assert (line.step, line.wall, line.ended) == (10, 7.0, False)
    assert line.seconds == {"imports": 3.0, "load": 0.5, "verify": 0.5, "setup": 3.0}


def test_the_unsaved_steps_are_kept_by_save_and_snapshot_not_by_step(tmp_path):
    """A run without checkpoints trains for days: what a death would lose stays one entry
    between two saves or snapshots, however many steps."""
    clock = trained(tmp_path, "failed", "s" * 1000 + "S" + "s" * 1000 + "P" + "s" * 10)
    assert len(clock.unsaved) == 3
    assert clock.uncommitted == pytest.approx(2010.0)


# (case, the control word a 5-second poll returns, the bucket its wait lands in, this rank's
# step's bucket after it)
POLLS = [
    ("every rank well: records", Signals(), Bucket.LOGGING, Bucket.PRODUCTIVE),
    ("a peer stalled or died: the time to detect it", Signals(health_failed=True), Bucket.HANG, Bucket.PRODUCTIVE),
    ("a peer's step not finite: this step dropped too", Signals(nonfinite=True), Bucket.LOGGING, Bucket.DROPPED),
    ("a shutdown asked for: records", Signals(shutdown_requested=True), Bucket.LOGGING, Bucket.PRODUCTIVE),
]  # fmt: skip


@pytest.mark.parametrize(
    "signals,waited_in,step_in", [p[1:] for p in POLLS], ids=[p[0] for p in POLLS]
)
def test_the_control_word_s_wait_lands_in_the_bucket_its_word_says(
    tmp_path, signals, waited_in, step_in
):
    now = [0.0]
    clock = LaunchClock(tmp_path, True, 0.0, clock=lambda: now[0])
    clock.step_done(OK, 1.0, 1)

    def poll(result: StepResult) -> Signals:
        now[0] += 5.0
        return signals

    assert timed_poll(poll, clock)(OK) is signals
    assert clock.seconds[waited_in] == pytest.approx(5.0)
    assert clock.seconds[step_in] == pytest.approx(1.0)
    assert sum(clock.seconds.values()) == pytest.approx(6.0)
