"""The loop's values and its pure decisions. No torch here: every function is table-tested.

One step of the reducer: ``plan_step(state, result, signals, policy) -> StepPlan``, whose
``state`` is the next ``LoopState`` and whose flags say which effects run.

Bookkeeping rule for a non-finite (skipped) step: the update is dropped, but the step counter,
the LR schedule position, the data position and the token count all advance as for a normal
step, and the shutdown poll and checkpoint gate still run.
"""

from __future__ import annotations

import enum
import math

import attrs

from forge.checkpoint.policy import SaveSchedule
from forge.training.outcome import LoopOutcome


@attrs.frozen
class LoopState:
    """Everything the loop carries from one step to the next."""

    step: int = 0  # optimizer steps taken so far (the next step to run has this index)
    tokens_seen: int = 0
    nonfinite_streak: int = 0
    last_saved_step: int | None = None
    last_step_finite: bool = True


@attrs.frozen
class StepResult:
    """What one optimizer step reports back (already world-reduced)."""

    loss: float
    grad_norm: float
    tokens: int
    lr: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


@attrs.frozen
class Signals:
    """External conditions polled once per step."""

    shutdown_requested: bool = False
    health_failed: bool = False


@attrs.frozen
class LoopPolicy:
    """The loop's fixed parameters. ``schedule`` None: checkpointing is off."""

    max_steps: int
    log_interval: int = 10
    eval_interval: int = 0
    schedule: SaveSchedule | None = None
    nonfinite_limit: int = 3


class SaveReason(enum.Enum):
    SCHEDULED = "scheduled"
    EMERGENCY = "emergency"
    FINAL = "final"


@attrs.frozen
class StepPlan:
    """The next state and the effects to run after one step."""

    state: LoopState
    log: bool = False
    evaluate: bool = False
    save: SaveReason | None = None
    stop: LoopOutcome | None = None


def advance(state: LoopState, result: StepResult) -> LoopState:
    """Bookkeeping after a step, skipped or not (see the module docstring)."""
    return attrs.evolve(
        state,
        step=state.step + 1,
        tokens_seen=state.tokens_seen + result.tokens,
        nonfinite_streak=0 if result.finite else state.nonfinite_streak + 1,
        last_step_finite=result.finite,
    )


def stop_outcome(state: LoopState, signals: Signals, policy: LoopPolicy) -> LoopOutcome | None:
    """Why the loop stops after reaching ``state``, most severe first; None to go on."""
    if signals.health_failed:
        return LoopOutcome.HEALTH_FAILURE
    if state.nonfinite_streak >= policy.nonfinite_limit:
        return LoopOutcome.NAN_ABORT
    if signals.shutdown_requested:
        return LoopOutcome.SHUTDOWN
    if state.step >= policy.max_steps:
        return LoopOutcome.COMPLETED
    return None


def save_reason(
    state: LoopState, stop: LoopOutcome | None, policy: LoopPolicy
) -> SaveReason | None:
    """Scheduled or emergency save after reaching ``state``; never on a failure stop."""
    if policy.schedule is None or stop in (LoopOutcome.HEALTH_FAILURE, LoopOutcome.NAN_ABORT):
        return None
    if stop is LoopOutcome.SHUTDOWN:
        return SaveReason.EMERGENCY
    if policy.schedule.should_save(state.step):
        return SaveReason.SCHEDULED
    return None


def plan_step(
    state: LoopState, result: StepResult, signals: Signals, policy: LoopPolicy
) -> StepPlan:
    """Pure: the next state and which effects (log, eval, save, stop) follow this step."""
    nxt = advance(state, result)
    stop = stop_outcome(nxt, signals, policy)
    reason = save_reason(nxt, stop, policy)
    if reason is not None:
        nxt = attrs.evolve(nxt, last_saved_step=nxt.step)
    healthy_stop = stop in (None, LoopOutcome.COMPLETED, LoopOutcome.SHUTDOWN)
    return StepPlan(
        state=nxt,
        log=nxt.step % policy.log_interval == 0 or stop is not None or nxt.step == 1,
        evaluate=policy.eval_interval > 0
        and nxt.step % policy.eval_interval == 0
        and healthy_stop
        and stop is not LoopOutcome.SHUTDOWN,
        save=reason,
        stop=stop,
    )


def starting_outcome(state: LoopState, policy: LoopPolicy) -> LoopOutcome | None:
    """ALREADY_COMPLETE when a resumed run has nothing left to do."""
    return LoopOutcome.ALREADY_COMPLETE if state.step >= policy.max_steps else None


def saves_initial_milestone(state: LoopState, policy: LoopPolicy) -> bool:
    """A fresh run saves ``step_0`` when step 0 is a milestone of the dynamic window."""
    return (
        policy.schedule is not None
        and state.step == 0
        and state.last_saved_step is None
        and policy.schedule.is_milestone(0)
    )
