"""How a training loop ended: the process exit code for each ending, and a sentence for the
ones a user may not expect. No torch here."""

from __future__ import annotations

import pathlib

from forge.config.sections import NonFinitePolicy
from forge.config.train import FLOAT8_OFF
from forge.resilience.stacks import every_rank
from forge.training.loop.plan import LoopPolicy
from forge.types import ExitCode, LoopOutcome, LoopState

_EXIT_CODES = {
    LoopOutcome.COMPLETED: ExitCode.OK,
    LoopOutcome.ALREADY_COMPLETE: ExitCode.OK,
    LoopOutcome.DATA_EXHAUSTED: ExitCode.OK,
    LoopOutcome.NAN_ABORT: ExitCode.NAN_ABORT,
    LoopOutcome.HEALTH_FAILURE: ExitCode.HEALTH_FAILURE,
    LoopOutcome.SHUTDOWN: ExitCode.SHUTDOWN,
    LoopOutcome.REPLAY_MISMATCH: ExitCode.REPLAY_MISMATCH,
    LoopOutcome.FLOAT8_DRIFT: ExitCode.FLOAT8_DRIFT,
}


def exit_code(outcome: LoopOutcome) -> int:
    """The process exit code documented for ``outcome``."""
    return int(_EXIT_CODES[outcome])


def outcome_message(
    outcome: LoopOutcome, state: LoopState, policy: LoopPolicy, run_dir: str
) -> str | None:
    """A plain sentence for an ending the user may not expect, else None."""
    step, max_steps = state.step, policy.max_steps
    if outcome is LoopOutcome.NAN_ABORT:
        failed = state.step if state.failed_at is None else state.failed_at
        if policy.nonfinite_policy is NonFinitePolicy.ABORT and (
            state.nonfinite_streak < policy.nonfinite_limit  # the first, not a streak
        ):
            return (
                f"step {failed} was not finite and resilience.on_nonfinite = 'abort' ends the "
                "run at the first such step: look at that step's data or lower the LR, then "
                "resume from the last checkpoint (or set on_nonfinite to 'skip' or 'rollback')"
            )
        recurred = any(first <= failed <= last for first, last in state.skipped_ranges)
        again = ", failing again each time the run rolled back and came to it" if recurred else ""
        return (
            f"{state.nonfinite_streak} steps dropped (non-finite or spiking) without an applied "
            f"step past step {failed}{again}; resilience.max_consecutive_nonfinite="
            f"{policy.nonfinite_limit}: lower the LR or look at that step's data, then resume "
            "from the last checkpoint"
        )
    if outcome is LoopOutcome.ALREADY_COMPLETE:
        where = (
            f"is already complete at step {step} (train.max_steps={max_steps})"
            if step == max_steps
            else f"is at step {step}, past train.max_steps={max_steps}: nothing to train"
        )
        return (
            f"the run in {run_dir} {where}; to train it further raise --train.max_steps "
            f"above {step} (where "
            "the LR decay depends on it, add --checkpoint.schedule_from=checkpoint to keep the "
            "schedule as it ran or =config to follow the longer one), or choose a new "
            "--run.dir to start a new run"
        )
    if outcome is LoopOutcome.HEALTH_FAILURE:
        return (
            f"a rank stalled or died after step {step}: where each rank was is in "
            f"{every_rank(pathlib.Path(run_dir))}; check the other ranks' logs, then resume "
            "(no rank died, only slow? raise resilience.health_timeout_s, the bound on each "
            "step's control word, or distributed.timeout_s, on a collective)"
        )
    if outcome is LoopOutcome.REPLAY_MISMATCH:
        return (
            f"replayed step {step} found no majority, or replicas disagreed on it (the error "
            "above names the rank and host): no checkpoint of that step or later was saved; "
            "resume from the last one on other hardware"
        )
    if outcome is LoopOutcome.FLOAT8_DRIFT:
        return (
            f"step {step} in FP8 drifted from its high-precision recomputation (the line "
            "above gives by how much) and train.float8_on_drift='stop': it was not applied and "
            "no checkpoint of it was saved; resume from the last checkpoint with "
            f"{FLOAT8_OFF}, or with a wider train.float8_check_tolerance if the drift is "
            "expected"
        )
    return None


def log_failure_line(failure: str, outcome: LoopOutcome, step: int, checkpointing: bool) -> str:
    """The line for a run whose metrics could not be written (``failure`` says which records
    were lost): it stopped at the next step, or it had ended anyway."""
    fix = "free space on that disk or raise the file-size limit (ulimit -f)"
    if outcome is LoopOutcome.SHUTDOWN:
        saved = " with a checkpoint" if checkpointing else ""
        return f"{failure}; the run stopped at step {step}{saved}: {fix}, then run again to resume"
    return f"{failure}; the run ended {outcome.value} at step {step}: {fix} before the next run"
