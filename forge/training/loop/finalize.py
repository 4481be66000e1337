"""The final-save decision. This module must not import torch: it is tested without it.

``finalize(outcome, ckpt)`` answers one question after the loop: does the run need one more
checkpoint? The caller makes that save (if any) and then waits for in-flight saves (save → wait).
"""

from __future__ import annotations

import enum

import attrs

from forge.types import LoopOutcome

# endings after which the last state is not trusted: no save, scheduled or final
FAILURES = (
    LoopOutcome.NAN_ABORT,
    LoopOutcome.HEALTH_FAILURE,
    LoopOutcome.REPLAY_MISMATCH,
    LoopOutcome.FLOAT8_DRIFT,
)


@attrs.frozen
class CheckpointView:
    """All ``finalize`` may know about checkpoints: plain values, no torch."""

    step: int
    max_steps: int
    last_saved_step: int | None
    last_step_finite: bool = True
    enabled: bool = True
    # the skipped steps' updates were dropped before optimizer.step (forge's step functions
    # guarantee it), so the weights are the finite weights of the last finite step
    skips_keep_weights: bool = True
    nonfinite_streak: int = 0  # how many steps in a row, up to ``step``, were skipped

    @property
    def last_finite_step(self) -> int:
        """The step whose weights the model holds after the trailing skipped steps."""
        return self.step - (0 if self.last_step_finite else max(self.nonfinite_streak, 1))


class FinalSaveReason(enum.Enum):
    CLEAN_FINISH = "clean finish off-schedule: save the final weights"
    DATA_EXHAUSTED = "data ran out early: save the step reached"
    ALREADY_SAVED = "this step is already saved (on schedule, or an emergency save)"
    NONFINITE_LAST_STEP = "last step was non-finite and its weights may be corrupt: no save"
    SKIPPED_LAST_STEP = (
        "last step was skipped as non-finite: save its state (the finite weights of the step "
        "before, the data position of this one) so no finite work is lost"
    )
    NONFINITE_STATE_SAVED = "last step was skipped; a checkpoint already holds its weights"
    FAILURE = "the run failed: its last state is not trusted"
    SHUTDOWN = "shutdown: the emergency save covered this step"
    NOTHING_TRAINED = "no step ran in this process"
    DISABLED = "checkpointing is disabled"


@attrs.frozen
class FinalSave:
    """Whether to save once more, at which step, and why."""

    save: bool
    step: int | None
    reason: FinalSaveReason


def _no(reason: FinalSaveReason) -> FinalSave:
    return FinalSave(save=False, step=None, reason=reason)


def finalize(outcome: LoopOutcome, ckpt: CheckpointView) -> FinalSave:
    """Decide the final save for a loop that ended with ``outcome``."""
    if not ckpt.enabled:
        return _no(FinalSaveReason.DISABLED)
    if outcome in FAILURES:
        return _no(FinalSaveReason.FAILURE)
    if outcome is LoopOutcome.SHUTDOWN:
        return _no(FinalSaveReason.SHUTDOWN)
    if outcome is LoopOutcome.ALREADY_COMPLETE:
        return _no(FinalSaveReason.NOTHING_TRAINED)
    if ckpt.last_saved_step == ckpt.step:
        return _no(FinalSaveReason.ALREADY_SAVED)
    if not ckpt.last_step_finite:
        if not ckpt.skips_keep_weights:
            return _no(FinalSaveReason.NONFINITE_LAST_STEP)
        saved = ckpt.last_saved_step
        if saved is not None and saved >= ckpt.last_finite_step:
            return _no(FinalSaveReason.NONFINITE_STATE_SAVED)
        return FinalSave(save=True, step=ckpt.step, reason=FinalSaveReason.SKIPPED_LAST_STEP)
    if outcome is LoopOutcome.DATA_EXHAUSTED:
        if ckpt.step == 0:
            return _no(FinalSaveReason.NOTHING_TRAINED)
        return FinalSave(save=True, step=ckpt.step, reason=FinalSaveReason.DATA_EXHAUSTED)
    return FinalSave(save=True, step=ckpt.step, reason=FinalSaveReason.CLEAN_FINISH)
