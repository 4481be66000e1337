"""A resume from the run's own checkpoints (``resume_run``): what it checks beside the
tensors (the run it continues: model, data order, freeze schedule, ``check_same_run``; the
optimizer, schedule and numerics settings, ``check_settings``), the optimizer's stage under a
freeze schedule, and what it restores."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

from forge.checkpoint.integrity import IntegrityError, verify_checkpoint
from forge.checkpoint.resume import ResumePlan, first_loadable
from forge.checkpoint.store import (
    CheckpointError,
    check_loadable,
    load_checkpoint,
    read_train_state,
)
from forge.config.freeze import trainable_names
from forge.config.loader import CONVERTER, ConfigError
from forge.config.sections import CheckpointConfig, FreezeRule, ScheduleName, Verification
from forge.optim.freezing import Freezer
from forge.optim.schedules import Schedule
from forge.parallel.mesh import broadcast_from_main
from forge.training.config_changes import (
    ChangeVerdict,
    change_verdict,
    current_settings,
    setting_changes,
)
from forge.training.context import (
    CheckpointContext,
    DataContext,
    DistContext,
    ModelContext,
    RunContext,
)
from forge.training.identity import (
    ResumeVerdict,
    identity_differences,
    recorded_freeze,
    resume_verdict,
    run_identity,
)
from forge.training.train_state import TrainState, parse_train_state


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


def verified_by_main(path: pathlib.Path, mode: Verification, dist: DistContext) -> None:
    """Verify ``path``'s bytes (``mode``) once, on rank 0, and raise the same
    ``CheckpointError`` on every rank when they do not verify, so that every rank takes the
    same fallback."""
    problem = None
    if dist.is_main and mode is Verification.FULL:
        try:
            verify_checkpoint(path, mode)
        except IntegrityError as exc:
            problem = exc.lines
    problem = broadcast_from_main(problem, dist.world_size)
    if problem:
        raise CheckpointError(problem)  # type: ignore[arg-type]


def check_settings(
    train_state: TrainState,
    current: dict,
    path: pathlib.Path,
    cfg: CheckpointConfig,
    say: Callable[[str], None],
    trains: bool = True,
) -> ChangeVerdict:
    """Refuse (``RunMismatchError``, a line per refused group) a resume whose optimizer or LR
    schedule settings differ from the checkpoint's, unless ``checkpoint.exclude_from_loading``
    or ``checkpoint.schedule_from`` says what to do; say what is accepted with a warning."""
    changes = setting_changes(train_state.settings or {}, current)
    exclude = "optimizer" in cfg.exclude_from_loading
    verdict = change_verdict(
        changes, str(path), train_state.step, exclude, cfg.schedule_from, trains
    )
    if verdict.refusals:
        raise RunMismatchError(list(verdict.refusals))
    for warning in verdict.warnings:
        say(f"warning: {warning}")
    return verdict


def recorded_schedule(train_state: TrainState) -> tuple[Schedule, float]:
    """The LR schedule and peak LR the checkpoint's run followed (``schedule_from =
    "checkpoint"``)."""
    record, settings = train_state.schedule, train_state.settings or {}
    schedule = Schedule(
        ScheduleName(record.name),
        record.warmup_steps,
        record.decay_steps,
        float(settings.get("scheduler.min_lr_ratio", 0.0)),
        record.total_steps,
    )
    return schedule, float(settings["optimizer.lr"])


def resume_run(
    run: RunContext,
    dist: DistContext,
    model: ModelContext,
    data: DataContext,
    plan: ResumePlan,
    say: Callable[[str], None],
) -> CheckpointContext:
    """Restore the newest checkpoint of ``plan`` that loads into the model, optimizer and
    loader. Each is checked whole (bytes, train state, run identity, settings) before any
    tensor is loaded; a damaged one gives way to the next, a changed config is refused."""
    cfg = run.config.checkpoint
    identity = run_identity(run.config, dist.dp_size, data.fingerprints)
    current = current_settings(run.config, model.peak_lr, model.schedule)

    def load(path: pathlib.Path) -> tuple[TrainState, ChangeVerdict]:
        check_loadable(path, model.model, Verification.METADATA)  # safe reads first: a
        verified_by_main(path, cfg.verify, dist)  # file carrying code is refused, not skipped
        train_state = parse_train_state(read_train_state(path), path)
        check_same_run(train_state, identity, path, cfg.allow_config_change, say)
        trains = train_state.step < run.config.train.max_steps
        verdict = check_settings(train_state, current, path, cfg, say, trains)
        if model.freezer is not None:  # the optimizer as in the last step run
            hold_checkpoint_stage(model.freezer, train_state, run.config.freeze)
        optimizer = None if verdict.fresh_optimizer else model.optimizer
        load_checkpoint(
            path, model.model, optimizer, rank=dist.rank, verify=Verification.METADATA, say=say
        )
        return train_state, verdict

    assert plan.path is not None
    path, (train_state, verdict) = first_loadable((plan.path, *plan.fallbacks), load, say)
    state = train_state.loop_state
    data.train_loader.load_state_dict(CONVERTER.unstructure(train_state.loader))
    say(f"resumed from {path} at step {state.step}")
    if not verdict.keep_schedule:
        return CheckpointContext(plan=plan, initial_state=state)
    schedule, peak_lr = recorded_schedule(train_state)
    return CheckpointContext(plan, state, schedule=schedule, peak_lr=peak_lr)
