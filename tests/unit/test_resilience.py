"""The NaN state machine, the control word and fault parsing: pure tables, no process group."""

import math
import pathlib

import attrs
import pytest
import torch

from forge.checkpoint.policy import SaveSchedule
from forge.config.sections import NonFinitePolicy
from forge.resilience import faults
from forge.resilience.control import ControlChannel, StepMonitor, decode, encode
from forge.resilience.faults import Fault, FaultKind, NanInjector, parse_faults, with_faults
from forge.training.loop.plan import (
    LoopPolicy,
    NonFiniteAction,
    nonfinite_action,
    plan_step,
    rolled_back,
)
from forge.types import (
    Float8Drift,
    Float8Verdict,
    LoopOutcome,
    LoopState,
    LossStats,
    Signals,
    StepResult,
)

SKIP, ROLLBACK, ABORT = NonFinitePolicy.SKIP, NonFinitePolicy.ROLLBACK, NonFinitePolicy.ABORT
A = NonFiniteAction


# (policy, limit, streak, action)
MACHINE = [
    (SKIP, 3, 0, A.CONTINUE),
    (SKIP, 3, 1, A.SKIP),
    (SKIP, 3, 2, A.SKIP),
    (SKIP, 3, 3, A.ABORT),
    (ROLLBACK, 3, 0, A.CONTINUE),
    (ROLLBACK, 3, 1, A.ROLLBACK),
    (ROLLBACK, 3, 2, A.ROLLBACK),
    (ROLLBACK, 3, 3, A.ABORT),
    (ABORT, 3, 0, A.CONTINUE),
    (ABORT, 3, 1, A.ABORT),
    (SKIP, 1, 1, A.ABORT),
]


@pytest.mark.parametrize("policy,limit,streak,action", MACHINE)
def test_nonfinite_state_machine(policy, limit, streak, action):
    pol = LoopPolicy(max_steps=100, nonfinite_limit=limit, nonfinite_policy=policy)
    assert nonfinite_action(streak, pol) is action


OK = StepResult(loss=1.0, grad_norm=1.0, tokens=8, lr=0.1)
BAD = StepResult(loss=math.nan, grad_norm=1.0, tokens=8, lr=0.1)
ROLL = LoopPolicy(
    max_steps=10, schedule=SaveSchedule(4), nonfinite_policy=ROLLBACK, snapshot_interval=3
)

# (case, step before, streak, local result, control word, rollback, snapshot, save, stop)
PLANS = [
    ("finite step", 1, 0, OK, Signals(), False, False, None, None),
    ("snapshot interval", 2, 0, OK, Signals(), False, True, None, None),
    ("local NaN rolls back", 4, 0, BAD, Signals(nonfinite=True), True, False, None, None),
    ("peer's NaN rolls back here too", 4, 0, OK, Signals(nonfinite=True), True, False, None, None),
    ("no save on a rolled-back step", 3, 0, OK, Signals(nonfinite=True), True, False, None, None),
    (
        "no snapshot of a non-finite state",
        5,
        1,
        OK,
        Signals(nonfinite=True),
        True,
        False,
        None,
        None,
    ),
    (
        "rollback at max_steps does not complete",
        9,
        0,
        OK,
        Signals(nonfinite=True),
        True,
        False,
        None,
        None,
    ),
    (
        "limit reached aborts",
        4,
        2,
        OK,
        Signals(nonfinite=True),
        False,
        False,
        None,
        LoopOutcome.NAN_ABORT,
    ),
    (
        "shutdown beats rollback",
        4,
        0,
        OK,
        Signals(nonfinite=True, shutdown_requested=True),
        False,
        False,
        "emergency",
        LoopOutcome.SHUTDOWN,
    ),
    (
        "no snapshot when stopping",
        8,
        0,
        OK,
        Signals(shutdown_requested=True),
        False,
        False,
        "emergency",
        LoopOutcome.SHUTDOWN,
    ),
]


@pytest.mark.parametrize(
    "step,streak,result,signals,rollback,snapshot,save,stop",
    [p[1:] for p in PLANS],
    ids=[p[0] for p in PLANS],
)
def test_plan_step_with_rollback(step, streak, result, signals, rollback, snapshot, save, stop):
    plan = plan_step(LoopState(step=step, nonfinite_streak=streak), result, signals, ROLL)
    assert plan.rollback is rollback
    assert plan.snapshot is snapshot
    assert (plan.save.value if plan.save else None) == save
    assert plan.stop is stop


def test_rolled_back_state_keeps_data_and_records_the_window():
    current = LoopState(step=8, tokens_seen=64, nonfinite_streak=1, last_saved_step=8)
    snap = LoopState(step=6, tokens_seen=48, last_saved_step=4)
    after = rolled_back(current, snap)
    assert after.step == 6
    assert after.tokens_seen == 64  # the failing window's data stays consumed
    assert after.nonfinite_streak == 1
    assert after.last_saved_step == 8
    assert after.skipped_ranges == ((7, 8),)
    again = rolled_back(
        LoopState(step=9, tokens_seen=80, skipped_ranges=after.skipped_ranges), snap
    )
    assert again.skipped_ranges == ((7, 8), (7, 9))


def test_rolled_back_state_keeps_the_runs_counts_and_the_snapshots_statistics():
    current = LoopState(step=8, spikes=2, replay_mismatches=1, loss_stats=LossStats(8, 2.0, 0.1))
    snap = LoopState(step=6, spikes=1, loss_stats=LossStats(6, 2.5, 0.2))
    after = rolled_back(current, snap)
    assert (after.spikes, after.replay_mismatches) == (2, 1)
    assert after.loss_stats == snap.loss_stats


def checked(action: Float8Drift | None) -> StepResult:
    """A step checked against high precision, with the drift guard's ``action``."""
    return attrs.evolve(OK, float8=Float8Verdict(0.1, 0.1, action))


# (the step's result, the recorded fallback step before it, after it: step 5 runs)
FALLBACKS = [
    (OK, None, None),
    (checked(None), None, None),
    (checked(Float8Drift.WARN), None, None),
    (checked(Float8Drift.FALLBACK), None, 5),
    (OK, 3, 3),  # kept, once fallen back
    (BAD, 3, 3),
]


@pytest.mark.parametrize("result,before,after", FALLBACKS)
def test_the_step_of_an_fp8_fallback_is_kept_in_the_state_for_good(result, before, after):
    state = LoopState(step=4, float8_fallback_step=before)
    assert plan_step(state, result, Signals(), ROLL).state.float8_fallback_step == after


@pytest.mark.parametrize("fell_back", [None, 3])
def test_a_rollback_keeps_the_fallback_the_model_computes_under(fell_back):
    snapshot = LoopState(step=2)  # from before the fallback: the model computes as it does now
    current = LoopState(step=4, float8_fallback_step=fell_back)
    assert rolled_back(current, snapshot).float8_fallback_step == fell_back


@pytest.mark.parametrize(
    "signals",
    [Signals(), Signals(nonfinite=True), Signals(shutdown_requested=True, health_failed=True)],
)
def test_control_word_round_trips(signals):
    assert decode(encode(signals)) == signals


def test_control_word_max_is_the_union_of_flags():
    a, b = encode(Signals(nonfinite=True)), encode(Signals(shutdown_requested=True))
    assert decode([max(x, y) for x, y in zip(a, b, strict=True)]) == Signals(
        nonfinite=True, shutdown_requested=True
    )


def test_single_process_monitor_reports_local_flags():
    requested = {"v": False}
    monitor = StepMonitor(ControlChannel(1, 5.0), lambda: requested["v"], health_check_interval=2)
    assert monitor(OK) == Signals()
    assert monitor(BAD) == Signals(nonfinite=True)
    requested["v"] = True
    assert monitor(OK) == Signals(shutdown_requested=True)


# (case, this rank's save status (in flight, written), the word of the step)
SAVES = [
    ("no save in flight", (False, True), Signals()),
    ("a save still being written", (True, False), Signals(save_unwritten=True)),
    ("a save written: commit it", (True, True), Signals(save_written=True)),
]


@pytest.mark.parametrize("status,word", [r[1:] for r in SAVES], ids=[r[0] for r in SAVES])
def test_the_monitor_says_when_a_save_in_flight_is_written(status, word):
    monitor = StepMonitor(ControlChannel(1, 5.0), lambda: False, 0, lambda: status)
    assert monitor(OK) == word


def test_an_unwritten_save_on_any_rank_holds_the_commit():
    """The word is a MAX over ranks: one rank still writing keeps every rank from committing."""
    mine, peers = encode(Signals()), encode(Signals(save_unwritten=True))
    assert decode([max(x, y) for x, y in zip(mine, peers, strict=True)]).save_unwritten


# (text, faults)
FAULTS = [
    ("", ()),
    ("nan:step=3:rank=1", (Fault(FaultKind.NAN, 3, 1),)),
    ("signal:step=5:sig=USR1", (Fault(FaultKind.SIGNAL, 5, None, "USR1"),)),
    (
        "stall:step=4:rank=0:seconds=2.5, nan:step=1",
        (Fault(FaultKind.STALL, 4, 0, seconds=2.5), Fault(FaultKind.NAN, 1)),
    ),
    (
        "stall:step=9:until=/tmp/go:seconds=60",
        (Fault(FaultKind.STALL, 9, seconds=60, until="/tmp/go"),),
    ),
]


@pytest.mark.parametrize("text,faults", FAULTS)
def test_parse_faults(text, faults):
    assert parse_faults(text) == faults


@pytest.mark.parametrize(
    "text", ["boom:step=1", "nan", "nan:rank=1", "nan:step=x", "nan:step=1:when=now"]
)
def test_malformed_faults_are_rejected(text):
    with pytest.raises(ValueError, match="FORGE_FAULTS"):
        parse_faults(text)


class Clock:
    """``time``'s ``monotonic`` and ``sleep`` for ``faults``: sleeping advances it, and the
    ``touch_at``-th sleep makes the file ``path``."""

    def __init__(self, path: pathlib.Path, touch_at: int | None) -> None:
        self.now, self.sleeps, self.path, self.touch_at = 0.0, 0, path, touch_at

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        if self.sleeps == self.touch_at:
            self.path.touch()


# (the sleep that makes the file, the stall's bound, the sleeps it takes)
STALLS = [(3, 30.0, 3), (1, 30.0, 1), (None, 1.025, 21)]  # 0.05 s a sleep


@pytest.mark.parametrize("touch_at,seconds,sleeps", STALLS)
def test_a_stall_until_a_file_ends_when_it_appears_or_at_its_bound(
    tmp_path, monkeypatch, capsys, touch_at, seconds, sleeps
):
    clock = Clock(tmp_path / "release", touch_at)
    monkeypatch.setattr(faults, "time", clock)
    faults.stall(Fault(FaultKind.STALL, 1, seconds=seconds, until=str(clock.path)))
    assert clock.sleeps == sleeps
    said = capsys.readouterr().err
    assert ("not there after" in said) is (touch_at is None)  # a bound passed is said


def test_nan_injection_is_one_shot_and_rank_specific():
    inject = NanInjector(parse_faults("nan:step=2:rank=1"), rank=1)
    assert inject(1) == 1.0
    assert math.isnan(inject(2))
    assert inject(2) == 1.0  # a rolled-back step 2 runs clean
    assert NanInjector(parse_faults("nan:step=2:rank=1"), rank=0)(2) == 1.0


@pytest.mark.parametrize(
    "exc,failure",
    [
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms"), True),
        (RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5843"), True),
        (RuntimeError("NCCL communicator was aborted"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("Timed out"), False),
    ],
)
def test_collective_failures_are_told_apart_from_bugs(exc, failure):
    from forge.resilience.health import is_collective_failure

    assert is_collective_failure(exc) is failure


def test_guarded_step_reports_a_failed_collective_and_reraises_bugs():
    from forge.resilience.health import guard_collectives

    def broken(batch, state):
        raise RuntimeError("Connection closed by peer")

    def buggy(batch, state):
        raise RuntimeError("shape mismatch")

    assert guard_collectives(broken)(None, LoopState()).collective_failed
    with pytest.raises(RuntimeError, match="shape"):
        guard_collectives(buggy)(None, LoopState())


def test_a_failed_step_becomes_health_failure():
    from forge.resilience.health import failed_step

    monitor = StepMonitor(ControlChannel(1, 5.0), lambda: False, health_check_interval=0)
    word = monitor(failed_step())
    assert word.health_failed
    plan = plan_step(LoopState(step=3), failed_step(), word, LoopPolicy(max_steps=10))
    assert plan.stop is LoopOutcome.HEALTH_FAILURE and plan.save is None


def test_without_a_nan_fault_the_step_is_returned_unwrapped():
    def step(batches, state):
        return StepResult(loss=1.0, grad_norm=1.0, tokens=1, lr=0.1)

    model = torch.nn.Linear(2, 2)
    assert with_faults(step, model, parse_faults("signal:step=2"), rank=0) is step
    assert with_faults(step, model, parse_faults("nan:step=2:rank=1"), rank=0) is step


def test_a_nan_fault_poisons_the_model_outputs_of_its_step_only():
    model = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)

    def step(batches, state):
        loss = model(x).sum()
        return StepResult(loss=float(loss), grad_norm=0.0, tokens=1, lr=0.1)

    faulty = with_faults(step, model, parse_faults("nan:step=2"), rank=0)
    losses = [faulty(None, LoopState(step=k)).loss for k in range(3)]  # steps 1, 2, 3
    assert math.isfinite(losses[0]) and math.isnan(losses[1]) and losses[2] == losses[0]
    assert math.isfinite(faulty(None, LoopState(step=1)).loss)  # one-shot: a rerun is clean
    assert not model._forward_hooks  # the hook left with its step
