"""How a training loop ended, and the process exit code for each ending. No torch here."""

from __future__ import annotations

import enum


class LoopOutcome(enum.Enum):
    """The closed set of ways ``run_training_loop`` can end."""

    COMPLETED = "completed"  # reached train.max_steps
    ALREADY_COMPLETE = "already_complete"  # resumed at or past max_steps: zero iterations
    DATA_EXHAUSTED = "data_exhausted"  # train.max_epochs consumed before max_steps
    NAN_ABORT = "nan_abort"  # too many consecutive non-finite steps
    HEALTH_FAILURE = "health_failure"  # a rank failed the health check
    SHUTDOWN = "shutdown"  # a preemption signal; an emergency checkpoint was saved


CONFIG_ERROR_EXIT = 2  # bad config, data or checkpoint: nothing was trained
SAVE_FAILED_EXIT = 5  # a final or emergency save (or the last step's) could not be written
INTERRUPTED_EXIT = 130  # a second Ctrl-C: the save in progress was abandoned

_EXIT_CODES = {
    LoopOutcome.COMPLETED: 0,
    LoopOutcome.ALREADY_COMPLETE: 0,
    LoopOutcome.DATA_EXHAUSTED: 0,
    LoopOutcome.NAN_ABORT: 3,
    LoopOutcome.HEALTH_FAILURE: 4,
    LoopOutcome.SHUTDOWN: 75,  # EX_TEMPFAIL: "try again later", i.e. requeue and resume
}


def exit_code(outcome: LoopOutcome) -> int:
    """The process exit code documented for ``outcome``."""
    return _EXIT_CODES[outcome]


def outcome_message(outcome: LoopOutcome, step: int, max_steps: int, run_dir: str) -> str | None:
    """A plain sentence for an ending the user may not expect, else None."""
    if outcome is LoopOutcome.ALREADY_COMPLETE:
        return (
            f"the run in {run_dir} is already complete at step {step} (train.max_steps="
            f"{max_steps}); to train it further raise --train.max_steps above {step}, "
            "or choose a new --run.dir to start a new run"
        )
    return None
