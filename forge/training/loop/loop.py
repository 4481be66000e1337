"""The training loop as a reducer over steps. No torch here: effects are injected.

``run_training_loop`` pulls a batch, runs the step function, asks ``plan_step`` what follows,
hands the effects to the ``Effects`` object and carries the new ``LoopState`` on, until a plan
says stop. ``conclude`` then applies ``finalize``: the final save (if any), then the wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import attrs

from forge.training.loop.finalize import CheckpointView, FinalSave, finalize
from forge.training.loop.plan import (
    LoopPolicy,
    SaveReason,
    plan_step,
    rolled_back,
    saves_initial_milestone,
    starting_outcome,
)
from forge.types import LoopOutcome, LoopState, Signals, StepResult

BatchT = TypeVar("BatchT", contravariant=True)


class StepFn(Protocol[BatchT]):
    """The seam between loop and model: one optimizer step on one step's micro-batches."""

    def __call__(self, batch: BatchT, state: LoopState, /) -> StepResult: ...


class Effects(Protocol):
    """What the loop asks the outside world to do; tests pass spies, training the real one."""

    def save(self, state: LoopState, reason: SaveReason) -> None: ...
    def wait(self) -> None: ...
    def log(self, state: LoopState, result: StepResult) -> None: ...
    def evaluate(self, state: LoopState) -> None: ...
    def step_end(self, state: LoopState, result: StepResult) -> None: ...
    def snapshot(self, state: LoopState) -> None: ...
    def restore(self, state: LoopState) -> None: ...


def run_training_loop(
    state: LoopState,
    batches: Iterator[BatchT],
    step_fn: StepFn[BatchT],
    policy: LoopPolicy,
    effects: Effects,
    poll: Callable[[StepResult], Signals] = lambda _: Signals(),
) -> tuple[LoopOutcome, LoopState]:
    """Reduce steps into a final ``LoopState`` and say how the loop ended.

    ``poll(result)`` returns the control word for the step just run: this rank's conditions
    reduced over every rank, so that every branch below is taken by all ranks or none.
    """
    already = starting_outcome(state, policy)
    if already is not None:
        return already, state
    if saves_initial_milestone(state, policy):
        effects.save(state, SaveReason.SCHEDULED)
        state = attrs.evolve(state, last_saved_step=state.step)
    snapshot = state
    if policy.snapshots:
        effects.snapshot(state)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return LoopOutcome.DATA_EXHAUSTED, state
        result = step_fn(batch, state)
        if (rebase := healed_state(result)) is not None:  # the step ran from a peer's state
            state = rebase
            if policy.snapshots:
                effects.snapshot(state)
                snapshot = state
        plan = plan_step(state, result, poll(result), policy)
        state = plan.state
        if plan.log:  # the step that ran, even if it is about to be rolled back
            effects.log(state, result)
        if plan.rollback:
            effects.restore(snapshot)
            state = rolled_back(state, snapshot)
        if plan.snapshot:
            effects.snapshot(state)
            snapshot = state
        if plan.evaluate:
            effects.evaluate(state)
        if plan.save is not None:
            effects.save(state, plan.save)
        if plan.commit:  # written everywhere: committed now, not at the next save
            effects.wait()
        effects.step_end(state, result)
        if plan.stop is not None:
            return plan.stop, state


def healed_state(result: StepResult) -> LoopState | None:
    """The loop state a step started from when its replica group healed from a live peer
    inside it (``[fault_tolerance]``): the peer's, replacing this group's."""
    return result.replicas.rebase if result.replicas is not None else None


def checkpoint_view(state: LoopState, policy: LoopPolicy) -> CheckpointView:
    """The plain values ``finalize`` decides on."""
    return CheckpointView(
        step=state.step,
        max_steps=policy.max_steps,
        last_saved_step=state.last_saved_step,
        last_step_finite=state.last_step_finite,
        enabled=policy.schedule is not None,
        nonfinite_streak=state.nonfinite_streak,
    )


def conclude(
    outcome: LoopOutcome, state: LoopState, policy: LoopPolicy, effects: Effects
) -> tuple[FinalSave, LoopState]:
    """Apply ``finalize``: save if it says so, then wait for every in-flight save."""
    decision = finalize(outcome, checkpoint_view(state, policy))
    if decision.save:
        effects.save(state, SaveReason.FINAL)
        state = attrs.evolve(state, last_saved_step=state.step)
    effects.wait()
    return decision, state
