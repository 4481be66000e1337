"""What a resume checks and restores beside the tensors: the run it continues (model, data
order, freeze schedule), refused or warned about by ``check_same_run``, and the optimizer's
stage under a freeze schedule."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

from forge.config.freeze import trainable_names
from forge.config.loader import ConfigError
from forge.config.sections import FreezeRule
from forge.optim.freezing import Freezer
from forge.training.identity import (
    ResumeVerdict,
    identity_differences,
    recorded_freeze,
    resume_verdict,
)
from forge.training.train_state import TrainState


class RunMismatchError(ConfigError):
    """Resuming a checkpoint written by another model or another data order."""


def check_same_run(
    train_state: TrainState,
    identity: dict,
    path: pathlib.Path,
    allow_change: bool,
    say: Callable[[str], None],
) -> None:
    """Refuse (or, with ``checkpoint.allow_config_change``, warn about) a resume whose model or
    data order differs from what the checkpoint recorded."""
    differences = identity_differences(train_state.identity or {}, identity)
    verdict = resume_verdict(differences, allow_change)
    if verdict is ResumeVerdict.REFUSE:
        kinds = " and ".join(sorted({d.kind.value for d in differences}))
        raise RunMismatchError(
            f"{path}: written with a different {kinds}: "
            f"{'; '.join(d.describe() for d in differences)}; resume with the checkpoint's "
            "values, or set checkpoint.allow_config_change=true to continue anyway"
        )
    for d in differences if verdict is ResumeVerdict.WARN else ():
        say(f"warning: resuming {path} with a different {d.kind.value}: {d.describe()}")


def hold_checkpoint_stage(
    freezer: Freezer, train_state: TrainState, rules: Sequence[FreezeRule]
) -> None:
    """Put the optimizer in the stage of the checkpoint's last step, under the freeze
    schedule that run recorded (``rules`` when it predates them), so its state loads; the
    current schedule takes over at the next step."""
    recorded = recorded_freeze(train_state.identity or {})
    last = max(1, train_state.step)
    schedule = recorded if recorded is not None else rules
    freezer.hold(trainable_names(freezer.params, schedule, last), last)
