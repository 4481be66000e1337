"""A resume from the run's own checkpoints (``resume_run``), and any start's check of the run's
records against the checkpoints it found (``records_ahead``): what a resume checks beside the
tensors (the run it recorded against this config, ``check_changes``: the model, data order and
freeze schedule, the optimizer, schedule and numerics), the optimizer's stage under a freeze
schedule, and what it restores."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from forge.checkpoint.costs import ResumeCost
from forge.checkpoint.integrity import IntegrityError, verify_checkpoint
from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.resume import ResumePlan, first_loadable, newest_committed
from forge.checkpoint.store import (
    TRAIN_STATE,
    CheckpointError,
    ShapeMismatchError,
    check_loadable,
    load_checkpoint,
    read_train_state,
)
from forge.config.freeze import trainable_names
from forge.config.loader import CONVERTER, ConfigError
from forge.config.sections import CheckpointConfig, FreezeRule, ScheduleName, Verification
from forge.data.loader import loader_state
from forge.data.shards import DataError
from forge.optim.freezing import Freezer
from forge.optim.schedules import Schedule
from forge.parallel.mesh import broadcast_from_main
from forge.training.context import (
    CheckpointContext,
    DataContext,
    DistContext,
    ModelContext,
    RunContext,
)
from forge.training.records.resume_rules import (
    ChangeGroup,
    ChangeOptions,
    ChangeVerdict,
    change_verdict,
    changes,
)
from forge.training.records.run_record import (
    current_settings,
    predated_model_defaults,
    recorded_freeze,
    run_identity,
)
from forge.training.records.run_records import (
    LostCheckpointsError,
    last_recorded_commit,
    lost_checkpoints_problem,
)
from forge.training.records.train_state import TrainState, parse_train_state


class RunMismatchError(ConfigError):
    """Resuming a checkpoint written by another model or another data order."""


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


def verified_by_main(path: CheckpointPath, mode: Verification, dist: DistContext) -> None:
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


def check_changes(
    train_state: TrainState,
    current: dict,
    path: CheckpointPath,
    cfg: CheckpointConfig,
    say: Callable[[str], None],
    trains: bool = True,
) -> ChangeVerdict:
    """Refuse (``RunMismatchError``, a line per refused kind) a resume whose recorded run
    (identity and settings) differs from ``current`` in a way ``[checkpoint]`` does not say
    what to do about (``forge.training.records.resume_rules``); say what is accepted with a
    warning."""
    recorded = (train_state.identity or {}) | (train_state.settings or {})
    found = changes(recorded, current, predated_model_defaults())
    options = ChangeOptions(
        cfg.allow_config_change, "optimizer" in cfg.exclude_from_loading, cfg.schedule_from
    )
    verdict = change_verdict(found, str(path), train_state.step, options, trains)
    if verdict.refusals:
        raise RunMismatchError(list(verdict.refusals))
    for warning in verdict.warnings:
        say(f"warning: {warning}")
    return verdict


def model_refusal(
    exc: ShapeMismatchError, path: CheckpointPath, current: dict
) -> ShapeMismatchError:
    """``exc`` (a tensor the model lacks or shapes otherwise) said by the ``[model]`` keys that
    changed, where the checkpoint records them: no setting loads other shapes."""
    try:
        recorded = parse_train_state(read_train_state(path), path).identity or {}
    except (CheckpointError, OSError, ValueError):
        return exc
    found = changes(recorded, current, predated_model_defaults())
    model = [c.describe() for c in found if c.group is ChangeGroup.MODEL]
    if not model:
        return exc
    return ShapeMismatchError(
        f"{path}: written for another model (the checkpoint's → this config's): "
        f"{'; '.join(model)}; its tensors do not fit this one (not even with "
        "checkpoint.allow_config_change): resume with the checkpoint's values, or choose a "
        "new run.dir"
    )


def loader_position(train_state: TrainState, data: DataContext, path: CheckpointPath) -> None:
    """Check, before any tensor loads, that the train loader can seek to the checkpoint's
    position; a ``CheckpointError`` (damage: the next checkpoint is tried) naming it if not."""
    try:
        loader_state(CONVERTER.unstructure(train_state.loader), data.train_loader.sampling)
    except DataError as exc:
        raise CheckpointError(f"{path / TRAIN_STATE}: {exc}") from None


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
    tensor is loaded; a damaged one gives way to the next, a changed config is refused; the
    run's records past its checkpoints are refused first (``records_ahead``)."""
    rewound_from = records_ahead(run, dist, plan, say)
    cfg = run.config.checkpoint
    current = run_identity(run.config, dist.dp_size, data.fingerprints) | current_settings(
        run.config, model.peak_lr, model.schedule
    )

    spent = {"load": 0.0, "verify": 0.0}  # every candidate's, one that gave way included

    def load(path: CheckpointPath) -> tuple[TrainState, ChangeVerdict]:
        try:  # safe reads first: a file carrying code is refused, not skipped
            check_loadable(path, model.model, Verification.METADATA)
        except ShapeMismatchError as exc:
            raise model_refusal(exc, path, current) from None
        start = time.perf_counter()
        try:
            verified_by_main(path, cfg.verify, dist)
        finally:
            spent["verify"] += time.perf_counter() - start
        train_state = parse_train_state(read_train_state(path), path)
        trains = train_state.step < run.config.train.max_steps
        verdict = check_changes(train_state, current, path, cfg, say, trains)
        loader_position(train_state, data, path)  # a position the loader cannot take: damage
        if model.freezer is not None:  # the optimizer as in the last step run
            hold_checkpoint_stage(model.freezer, train_state, run.config.freeze)
        optimizer = None if verdict.fresh_optimizer else model.optimizer
        start = time.perf_counter()
        load_checkpoint(
            path, model.model, optimizer, rank=dist.rank, verify=Verification.METADATA, say=say
        )
        spent["load"] += time.perf_counter() - start
        return train_state, verdict

    assert plan.path is not None
    path, (train_state, verdict) = first_loadable((plan.path, *plan.fallbacks), load, say)
    state = train_state.loop_state
    data.train_loader.load_state_dict(CONVERTER.unstructure(train_state.loader))
    say(f"resumed from {path} at step {state.step}")
    cost = ResumeCost(spent["load"], spent["verify"])
    if not verdict.keep_schedule:
        return CheckpointContext(plan, state, resume_cost=cost, rewound_from=rewound_from)
    schedule, peak_lr = recorded_schedule(train_state)
    return CheckpointContext(
        plan, state, schedule, peak_lr, resume_cost=cost, rewound_from=rewound_from
    )


def records_ahead(
    run: RunContext, dist: DistContext, plan: ResumePlan, say: Callable[[str], None]
) -> int | None:
    """The step the run's records say was committed, when the checkpoints found are older
    and ``checkpoint.allow_rewind`` accepts going back; ``LostCheckpointsError`` on every rank
    when it does not; None when the records and the checkpoints agree."""
    problem, recorded = None, None
    if dist.is_main:
        recorded = last_recorded_commit(run.run_dir)
        problem = lost_checkpoints_problem(
            recorded, newest_committed(plan), run.run_dir, run.checkpoint_dir
        )
    problem, recorded = broadcast_from_main((problem, recorded), dist.world_size)  # type: ignore[misc]
    if problem is None:
        return None
    if not run.config.checkpoint.allow_rewind:
        raise LostCheckpointsError(problem)
    say(f"warning: going back on purpose (checkpoint.allow_rewind): {problem}")
    return recorded
