"""plan_step: the pure per-step decision, one row per case."""

import math

import pytest

from forge.checkpoint.policy import SaveSchedule
from forge.training.loop.plan import (
    LoopPolicy,
    SaveReason,
    plan_step,
    saves_initial_milestone,
    starting_outcome,
)
from forge.types import LoopOutcome, LoopState, Signals, StepResult

OK = StepResult(loss=2.0, grad_norm=1.0, tokens=8, lr=0.1)
NAN_LOSS = StepResult(loss=math.nan, grad_norm=1.0, tokens=8, lr=0.1)
INF_NORM = StepResult(loss=2.0, grad_norm=math.inf, tokens=8, lr=0.1)
POLICY = LoopPolicy(
    max_steps=10, log_interval=5, eval_interval=4, schedule=SaveSchedule(3), nonfinite_limit=2
)
QUIET = Signals()
TERM = Signals(shutdown_requested=True)
SICK = Signals(health_failed=True)
BOTH = Signals(shutdown_requested=True, health_failed=True)

# (case, step before, streak before, result, signals, stop, save, log, evaluate)
ROWS = [
    ("plain step", 1, 0, OK, QUIET, None, None, False, False),
    ("first step is logged", 0, 0, OK, QUIET, None, None, True, False),
    ("log interval", 4, 0, OK, QUIET, None, None, True, False),
    ("save interval", 2, 0, OK, QUIET, None, SaveReason.SCHEDULED, False, False),
    ("eval interval", 3, 0, OK, QUIET, None, None, False, True),
    ("last step", 9, 0, OK, QUIET, LoopOutcome.COMPLETED, None, True, False),
    ("last step on schedule", 8, 0, OK, Signals(), None, SaveReason.SCHEDULED, False, False),
    ("shutdown", 3, 0, OK, TERM, LoopOutcome.SHUTDOWN, SaveReason.EMERGENCY, True, False),
    (
        "shutdown on a scheduled step saves once",
        2,
        0,
        OK,
        TERM,
        LoopOutcome.SHUTDOWN,
        SaveReason.EMERGENCY,
        True,
        False,
    ),
    (
        "health failure: no logging (no collectives)",
        3,
        0,
        OK,
        SICK,
        LoopOutcome.HEALTH_FAILURE,
        None,
        False,
        False,
    ),
    (
        "health failure beats shutdown",
        3,
        0,
        OK,
        BOTH,
        LoopOutcome.HEALTH_FAILURE,
        None,
        False,
        False,
    ),
    ("one NaN under the limit", 1, 0, NAN_LOSS, QUIET, None, None, False, False),
    ("NaN reaching the limit", 1, 1, NAN_LOSS, QUIET, LoopOutcome.NAN_ABORT, None, True, False),
    ("inf grad norm counts", 1, 1, INF_NORM, QUIET, LoopOutcome.NAN_ABORT, None, True, False),
    ("NaN abort beats shutdown", 1, 1, NAN_LOSS, TERM, LoopOutcome.NAN_ABORT, None, True, False),
    (
        "a save written everywhere commits",
        1,
        0,
        OK,
        Signals(save_written=True),
        None,
        None,
        False,
        False,
    ),
    (
        "a save of this step commits the last itself",
        2,
        0,
        OK,
        Signals(save_written=True),
        None,
        SaveReason.SCHEDULED,
        False,
        False,
    ),
    (
        "NaN under the limit on a save step",
        2,
        0,
        NAN_LOSS,
        QUIET,
        None,
        SaveReason.SCHEDULED,
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    "step,streak,result,signals,stop,save,log,evaluate",
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_plan_step_table(step, streak, result, signals, stop, save, log, evaluate):
    plan = plan_step(LoopState(step=step, nonfinite_streak=streak), result, signals, POLICY)
    assert plan.stop is stop
    assert plan.save is save
    assert plan.log is log
    assert plan.evaluate is evaluate
    assert plan.state.step == step + 1
    assert plan.commit is (signals.save_written and save is None and stop is None)
    assert plan.state.tokens_seen == 8
    assert plan.state.last_step_finite is result.finite
    assert plan.state.last_saved_step == (step + 1 if save else None)


@pytest.mark.parametrize(
    "step,expected",
    [(0, None), (9, None), (10, LoopOutcome.ALREADY_COMPLETE), (11, LoopOutcome.ALREADY_COMPLETE)],
)
def test_starting_outcome(step, expected):
    assert starting_outcome(LoopState(step=step), POLICY) is expected


@pytest.mark.parametrize(
    "schedule,state,expected",
    [
        (SaveSchedule(5, 0, 8), LoopState(), True),
        (SaveSchedule(5, 1, 8), LoopState(), False),
        (SaveSchedule(5), LoopState(), False),
        (None, LoopState(), False),
        (SaveSchedule(5, 0, 8), LoopState(step=0, last_saved_step=0), False),
    ],
)
def test_initial_milestone(schedule, state, expected):
    pol = LoopPolicy(max_steps=10, schedule=schedule)
    assert saves_initial_milestone(state, pol) is expected
