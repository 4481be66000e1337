"""The loop driven by scripted step results and a spy: each finalize row end to end, no model."""

from __future__ import annotations

import math

import attrs
import pytest

from forge.checkpoint.policy import SaveSchedule
from forge.config.sections import NonFinitePolicy
from forge.training.loop.loop import conclude, run_training_loop
from forge.training.loop.plan import LoopPolicy, SaveReason
from forge.types import LoopOutcome, LoopState, Signals, StepResult

NAN = math.nan


class Spy:
    """Records every effect in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def save(self, state: LoopState, reason: SaveReason) -> None:
        self.calls.append(("save", state.step, reason))

    def wait(self) -> None:
        self.calls.append(("wait",))

    def log(self, state: LoopState, result: StepResult) -> None:
        self.calls.append(("log", state.step))

    def evaluate(self, state: LoopState) -> None:
        self.calls.append(("eval", state.step))

    def step_end(self, state: LoopState, result: StepResult) -> None:
        self.calls.append(("step_end", state.step))

    def snapshot(self, state: LoopState) -> None:
        self.calls.append(("snapshot", state.step))

    def restore(self, state: LoopState) -> None:
        self.calls.append(("restore", state.step))

    def saves(self) -> list[tuple[int, SaveReason]]:
        return [(c[1], c[2]) for c in self.calls if c[0] == "save"]


def scripted(losses: list[float]):
    """A step function that reports the scripted losses in order."""
    it = iter(losses)

    def step(batch: int, state: LoopState) -> StepResult:
        return StepResult(loss=next(it), grad_norm=1.0, tokens=4, lr=0.1)

    return step


def signals_at(shutdown: set[int] = frozenset(), health: set[int] = frozenset()):
    """A poll that reports a shutdown / health failure while step ``k`` (1-based) ends."""
    count = {"n": 0}

    def poll(_result: StepResult) -> Signals:
        count["n"] += 1
        return Signals(
            shutdown_requested=count["n"] in shutdown, health_failed=count["n"] in health
        )

    return poll


def policy(max_steps=10, interval=4, nonfinite_limit=3, **kw) -> LoopPolicy:
    return LoopPolicy(
        max_steps=max_steps,
        log_interval=100,
        schedule=SaveSchedule(interval=interval, **kw),
        nonfinite_limit=nonfinite_limit,
    )


def run(losses, pol, *, start=None, poll=None, batches=None):
    spy = Spy()
    start = start or LoopState()
    outcome, state = run_training_loop(
        start,
        iter(range(len(losses)) if batches is None else batches),
        scripted(losses),
        pol,
        spy,
        poll or (lambda _: Signals()),
    )
    decision, state = conclude(outcome, state, pol, spy)
    return outcome, state, decision, spy


S, E, F = SaveReason.SCHEDULED, SaveReason.EMERGENCY, SaveReason.FINAL

# (case, losses, policy, start, poll, batches, outcome, final step, saves)
ROWS = [
    (
        "clean finish off-schedule",
        [1.0] * 10,
        policy(10, 4),
        LoopState(),
        None,
        None,
        LoopOutcome.COMPLETED,
        10,
        [(4, S), (8, S), (10, F)],
    ),
    (
        "clean finish on-schedule",
        [1.0] * 8,
        policy(8, 4),
        LoopState(),
        None,
        None,
        LoopOutcome.COMPLETED,
        8,
        [(4, S), (8, S)],
    ),
    (
        "NaN on the last step: its state (step 9's weights) is saved",
        [1.0] * 9 + [NAN],
        policy(10, 4),
        LoopState(),
        None,
        None,
        LoopOutcome.COMPLETED,
        10,
        [(4, S), (8, S), (10, F)],
    ),
    (
        "NaN on the last step after a save of the step before",
        [1.0] * 9 + [NAN],
        policy(10, 3),
        LoopState(),
        None,
        None,
        LoopOutcome.COMPLETED,
        10,
        [(3, S), (6, S), (9, S)],
    ),
    (
        "NaN abort on the last step",
        [1.0] * 9 + [NAN],
        policy(10, 4, nonfinite_limit=1),
        LoopState(),
        None,
        None,
        LoopOutcome.NAN_ABORT,
        10,
        [(4, S), (8, S)],
    ),
    (
        "health failure on the last step",
        [1.0] * 10,
        policy(10, 4),
        LoopState(),
        signals_at(health={10}),
        None,
        LoopOutcome.HEALTH_FAILURE,
        10,
        [(4, S), (8, S)],
    ),
    (
        "shutdown on the last step",
        [1.0] * 10,
        policy(10, 4),
        LoopState(),
        signals_at(shutdown={10}),
        None,
        LoopOutcome.SHUTDOWN,
        10,
        [(4, S), (8, S), (10, E)],
    ),
    (
        "shutdown mid-run",
        [1.0] * 10,
        policy(10, 4),
        LoopState(),
        signals_at(shutdown={6}),
        None,
        LoopOutcome.SHUTDOWN,
        6,
        [(4, S), (6, E)],
    ),
    (
        "resumed at max_steps",
        [],
        policy(10, 4),
        LoopState(step=10, last_saved_step=10),
        None,
        None,
        LoopOutcome.ALREADY_COMPLETE,
        10,
        [],
    ),
    (
        "data exhausted early",
        [1.0] * 7,
        policy(10, 4),
        LoopState(),
        None,
        range(7),
        LoopOutcome.DATA_EXHAUSTED,
        7,
        [(4, S), (7, F)],
    ),
    (
        "milestone at step 0 on a fresh run",
        [1.0] * 3,
        policy(3, 100, window_start=0, window_stop=2),
        LoopState(),
        None,
        None,
        LoopOutcome.COMPLETED,
        3,
        [(0, S), (1, S), (2, S), (3, F)],
    ),
]


@pytest.mark.parametrize(
    "losses,pol,start,poll,batches,outcome,final_step,saves",
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_loop_rows_end_to_end(losses, pol, start, poll, batches, outcome, final_step, saves):
    got_outcome, state, _, spy = run(losses, pol, start=start, poll=poll, batches=batches)
    assert got_outcome is outcome
    assert state.step == final_step
    assert spy.saves() == saves
    assert spy.calls[-1] == ("wait",), "the wait comes last, after any final save"


def test_resume_at_max_steps_runs_zero_iterations():
    _, _, _, spy = run([], policy(10, 4), start=LoopState(step=10, last_saved_step=10))
    assert [c for c in spy.calls if c[0] == "step_end"] == []
    assert spy.calls == [("wait",)]


def test_final_save_comes_before_the_wait():
    _, _, _, spy = run([1.0] * 5, policy(5, 4))
    kinds = [c[0] for c in spy.calls if c[0] in ("save", "wait")]
    assert kinds == ["save", "save", "wait"]


def test_skipped_step_keeps_bookkeeping_and_gate():
    """A NaN step still advances step and tokens, and the checkpoint gate still fires on it."""
    outcome, state, _, spy = run([1.0, 1.0, 1.0, NAN, 1.0], policy(5, 4))
    assert outcome is LoopOutcome.COMPLETED
    assert state.tokens_seen == 5 * 4
    assert (4, S) in spy.saves()


def test_consecutive_nonfinite_steps_abort_at_the_limit():
    outcome, state, decision, _ = run([1.0, NAN, NAN, NAN, 1.0], policy(10, 100, nonfinite_limit=3))
    assert outcome is LoopOutcome.NAN_ABORT
    assert state.step == 4
    assert not decision.save


def test_streak_resets_after_a_finite_step():
    outcome, _, _, _ = run([NAN, NAN, 1.0, NAN, NAN, 1.0], policy(6, 100, nonfinite_limit=3))
    assert outcome is LoopOutcome.COMPLETED


def test_checkpointing_disabled_never_saves():
    pol = attrs.evolve(policy(10, 4), schedule=None)
    _, _, decision, spy = run([1.0] * 10, pol)
    assert spy.saves() == []
    assert not decision.save


def failing_at(failures: dict[int, int], ran: list[int]):
    """A step function whose step ``k`` (1-based) is non-finite the first ``failures[k]`` times
    the run reaches it, as a fault tied to the step (its LR, its weights) would be; each step
    it runs is appended to ``ran``."""
    left = dict(failures)

    def step(batch: int, state: LoopState) -> StepResult:
        k = state.step + 1
        ran.append(k)
        bad = left.get(k, 0) > 0
        left[k] = left.get(k, 0) - bad
        return StepResult(loss=NAN if bad else 1.0, grad_norm=1.0, tokens=4, lr=0.1)

    return step


def recurring(nonfinite_policy: NonFinitePolicy, limit: int = 3, snapshots: int = 0):
    return attrs.evolve(
        policy(10, 100, nonfinite_limit=limit),
        nonfinite_policy=nonfinite_policy,
        snapshot_interval=snapshots,
    )


ROLL, SKIP = NonFinitePolicy.ROLLBACK, NonFinitePolicy.SKIP

# (case, policy, {step: times it fails}, outcome, the steps run in order)
RECURRING = [
    (
        "rollback: a step that always fails ends the run at the limit",
        recurring(ROLL, 3, snapshots=4),
        {6: 100},
        LoopOutcome.NAN_ABORT,
        [1, 2, 3, 4, 5, 6, 5, 6, 5, 6],
    ),
    (
        "rollback: a step failing six times is not rolled back six times",
        recurring(ROLL, 3, snapshots=4),
        {6: 6},
        LoopOutcome.NAN_ABORT,
        [1, 2, 3, 4, 5, 6, 5, 6, 5, 6],
    ),
    (
        "rollback: a step failing once less than the limit recovers",
        recurring(ROLL, 3, snapshots=4),
        {6: 2},
        LoopOutcome.COMPLETED,
        [1, 2, 3, 4, 5, 6, 5, 6, 5, 6, 7, 8, 9, 10],
    ),
    (
        "rollback: passing the failed step clears the streak",
        recurring(ROLL, 2, snapshots=2),
        {4: 1, 8: 1},
        LoopOutcome.COMPLETED,
        [1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 7, 8, 9, 10],
    ),
    (
        "rollback: the failed step itself applied clears the streak",
        recurring(ROLL, 2, snapshots=2),
        {3: 1, 4: 1},
        LoopOutcome.COMPLETED,
        [1, 2, 3, 3, 4, 3, 4, 5, 6, 7, 8, 9, 10],
    ),
    (
        "skip: the step counter moves on, the recurring step is skipped once",
        recurring(SKIP, 3),
        {6: 100},
        LoopOutcome.COMPLETED,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    ),
]


@pytest.mark.parametrize(
    "pol,failures,outcome,steps", [r[1:] for r in RECURRING], ids=[r[0] for r in RECURRING]
)
def test_a_recurring_failure_is_bounded(pol, failures, outcome, steps):
    ran: list[int] = []
    got, state = run_training_loop(
        LoopState(), iter(range(100)), failing_at(failures, ran), pol, Spy(), lambda _: Signals()
    )
    assert got is outcome
    assert ran == steps
    if outcome is LoopOutcome.NAN_ABORT:  # the step it could not pass, for the message
        assert state.failed_at == max(steps)


def test_a_save_written_everywhere_commits_at_the_next_step_not_the_next_save():
    """An async save of step 4 is written while step 5 runs: the loop commits it after step
    5 (``effects.wait``), not at the save of step 8; a stop or a save of its own step waits
    anyway."""
    spy = Spy()
    written = {"steps": {5}}

    def poll(result: StepResult) -> Signals:
        poll.n += 1  # type: ignore[attr-defined]
        return Signals(save_written=poll.n in written["steps"])  # type: ignore[attr-defined]

    poll.n = 0  # type: ignore[attr-defined]
    run_training_loop(LoopState(), iter(range(10)), scripted([1.0] * 10), policy(10, 4), spy, poll)
    effects = [c for c in spy.calls if c[0] in ("save", "wait")]
    assert effects == [("save", 4, S), ("wait",), ("save", 8, S)]
