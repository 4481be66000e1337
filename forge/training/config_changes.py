"""What a changed config means for a resume: every config key belongs to one group, and each
group has its own verdict. No torch here: the table and every decision are table-tested.

- ``IDENTITY`` (the model, the data and its order, seeds, sequence length, packing, the global
  batch, the freeze schedule): another run; refused, or with ``checkpoint.allow_config_change``
  continued with a warning (``forge.training.identity`` compares it).
- ``OPTIMIZER_STATE`` (the optimizer and the hyper-parameters it uses, ``train.param_dtype``):
  the saved state belongs to another optimizer; refused, never reported as damage;
  ``checkpoint.exclude_from_loading = ["optimizer"]`` continues with a fresh optimizer (only
  when they changed: a requeued run with the key still set keeps its optimizer state).
- ``SCHEDULE`` (``optimizer.lr``, ``[scheduler]``, and ``train.max_steps`` where the decay
  depends on it): refused, naming the keys; ``checkpoint.schedule_from = "checkpoint"`` keeps
  the recorded schedule, ``"config"`` switches to the new one at the resume step.
- ``NUMERICS`` (compute precision, clipping, the z-loss): the same state continues under other
  arithmetic; accepted with a warning (the run is no longer the uninterrupted one bit for bit).
- ``FREE`` (logging, evaluation, checkpointing, workers, hooks, the profiler, the layout):
  accepted without a word.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from forge.config.sections import JobConfig, ScheduleName, ScheduleSource

if TYPE_CHECKING:  # a type only: this module decides on plain values
    from forge.optim.schedules import Schedule


class ChangeGroup(enum.Enum):
    """What a change of a config key means for a resume."""

    IDENTITY = "run identity"
    OPTIMIZER_STATE = "optimizer state"
    SCHEDULE = "LR schedule"
    NUMERICS = "training numerics"
    FREE = "free"


G = ChangeGroup
# whole sections of one group
SECTION_GROUPS: dict[str, ChangeGroup] = {
    "run": G.FREE,
    "model": G.IDENTITY,
    "scheduler": G.SCHEDULE,
    "eval": G.FREE,
    "checkpoint": G.FREE,
    "metrics": G.FREE,
    "resilience": G.FREE,
    "distributed": G.FREE,  # a layout of the same global batch is the same run
    "hooks": G.FREE,
    "profiler": G.FREE,
    "freeze": G.IDENTITY,
}
# the keys of the sections that mix groups, one by one
KEY_GROUPS: dict[str, ChangeGroup] = {
    "train.batch_size": G.IDENTITY,  # through the global batch
    "train.seq_len": G.IDENTITY,
    "train.max_steps": G.SCHEDULE,  # through the resolved schedule (decay, WSD's tail)
    "train.max_epochs": G.FREE,
    "train.grad_accum_steps": G.IDENTITY,  # through the global batch
    "train.grad_clip_norm": G.NUMERICS,
    "train.seed": G.IDENTITY,
    "train.data_seed": G.IDENTITY,
    "train.mixed_precision": G.NUMERICS,
    "train.param_dtype": G.OPTIMIZER_STATE,
    "train.num_threads": G.FREE,
    "train.activation_checkpointing": G.FREE,
    "train.compile": G.FREE,
    "train.z_loss_weight": G.NUMERICS,
    "model.attention": G.NUMERICS,  # another kernel for the same function (identity.KERNELS)
    "train.loss_chunk_size": G.FREE,
    "optimizer.name": G.OPTIMIZER_STATE,
    "optimizer.lr": G.SCHEDULE,
    "optimizer.weight_decay": G.OPTIMIZER_STATE,  # the saved param groups carry it
    "optimizer.betas": G.OPTIMIZER_STATE,
    "optimizer.eps": G.OPTIMIZER_STATE,
    "optimizer.decay_embeddings": G.OPTIMIZER_STATE,  # which group each parameter is in
    "optimizer.momentum": G.OPTIMIZER_STATE,
    "optimizer.ns_steps": G.OPTIMIZER_STATE,
    "data.path": G.IDENTITY,  # through its dataset's fingerprint
    "data.train_split": G.IDENTITY,
    "data.eval_split": G.FREE,
    "data.verify_checksum": G.FREE,
    "data.sources": G.IDENTITY,
    "data.temperature": G.IDENTITY,
    "data.phases": G.IDENTITY,
    "data.pack_documents": G.IDENTITY,
    "data.num_workers": G.FREE,
}


DECAY = "decay steps (scheduler.decay_steps or train.max_steps)"
TOTAL = "total steps (train.max_steps)"
DERIVED_GROUPS = {DECAY: G.SCHEDULE, TOTAL: G.SCHEDULE}  # recorded settings that are no key


# optimizer keys an optimizer ignores (by optimizer.name): a change of one is no change
UNUSED_BY: dict[str, frozenset[str]] = {
    "adamw": frozenset({"optimizer.momentum", "optimizer.ns_steps"}),
    "schedule_free_adamw": frozenset({"optimizer.momentum", "optimizer.ns_steps"}),
    "lion": frozenset({"optimizer.eps", "optimizer.momentum", "optimizer.ns_steps"}),
    "muon": frozenset(),
}


def config_keys() -> list[str]:
    """Every key of the config: ``section.field``, or the section for an array of tables."""
    defaults, keys = JobConfig(), []
    for section in attrs.fields(JobConfig):
        value = getattr(defaults, section.name)
        if attrs.has(type(value)):
            keys += [f"{section.name}.{f.name}" for f in attrs.fields(type(value))]
        else:
            keys.append(section.name)
    return keys


def group_of(key: str) -> ChangeGroup:
    """The group of a config key (``KEY_GROUPS``, else its section's)."""
    if key in KEY_GROUPS:
        return KEY_GROUPS[key]
    return SECTION_GROUPS[key.split(".")[0]]


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def schedule_shape(
    name: ScheduleName, warmup: int, decay: int, min_ratio: float, total: int
) -> dict[str, Any]:
    """The values a resolved schedule's LR curve depends on (a constant schedule's does not
    depend on its decay, only WSD's on the total steps)."""
    if name is ScheduleName.NONE:
        return {"scheduler.name": name.value}
    shape: dict[str, Any] = {"scheduler.name": name.value, "scheduler.warmup_steps": warmup}
    if name is ScheduleName.CONSTANT:
        return shape
    shape |= {DECAY: decay, "scheduler.min_lr_ratio": min_ratio}
    if name is ScheduleName.WSD:
        shape[TOTAL] = total
    return shape


def recorded_settings(
    config: JobConfig, peak_lr: float, name: ScheduleName, warmup: int, decay: int,
    min_ratio: float, total: int,
) -> dict[str, Any]:  # fmt: skip
    """What a checkpoint records to compare a resume against, beyond the run's identity: the
    optimizer-state and numerics keys as configured, and the schedule as it runs (its peak LR
    and its resolved shape, ``schedule_shape``)."""
    unused = UNUSED_BY.get(config.optimizer.name.value, frozenset())
    settings = {
        key: _plain(getattr(getattr(config, key.split(".")[0]), key.split(".")[1]))
        for key in config_keys()
        if group_of(key) in (G.OPTIMIZER_STATE, G.NUMERICS) and key not in unused
    }
    settings["optimizer.lr"] = peak_lr
    return settings | schedule_shape(name, warmup, decay, min_ratio, total)


def current_settings(config: JobConfig, peak_lr: float | None, schedule: Schedule) -> dict:
    """``recorded_settings`` of a run under ``config`` whose step follows ``schedule`` at
    ``peak_lr`` (None: the config's ``optimizer.lr``)."""
    lr = config.optimizer.lr if peak_lr is None else peak_lr
    s = schedule
    return recorded_settings(
        config, lr, s.name, s.warmup_steps, s.decay_steps, s.min_lr_ratio, s.total_steps
    )


@attrs.frozen
class Change:
    """One recorded setting that differs from the config's."""

    key: str
    recorded: Any
    current: Any
    group: ChangeGroup

    def describe(self) -> str:
        return f"{self.key}: {self.recorded!r} → {self.current!r}"


def setting_changes(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[Change]:
    """Every recorded setting whose value differs from ``current`` (a key either lacks is not
    compared: an older checkpoint cannot say), each with its group."""
    changes = []
    for key in sorted(set(recorded) | set(current)):
        if key not in recorded or key not in current or recorded[key] == current[key]:
            continue
        group = DERIVED_GROUPS.get(key) or group_of(key)
        changes.append(Change(key, recorded[key], current[key], group))
    return changes


@attrs.frozen
class ChangeVerdict:
    """What a resume does about the changed settings: refuse (one line per refused group),
    or go on with these warnings, a fresh optimizer or the recorded schedule."""

    refusals: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    fresh_optimizer: bool = False
    keep_schedule: bool = False


def change_verdict(
    changes: list[Change],
    where: str,
    step: int,
    exclude_optimizer: bool,
    schedule_from: ScheduleSource | None,
    trains: bool = True,
) -> ChangeVerdict:
    """The verdict on ``changes`` for the checkpoint ``where`` of step ``step``, under
    ``checkpoint.exclude_from_loading`` (``exclude_optimizer``) and
    ``checkpoint.schedule_from``. A resume that ``trains`` no step (already complete) follows
    no schedule: its schedule changes do not matter."""
    by_group: dict[ChangeGroup, list[Change]] = {}
    for change in changes:
        if trains or change.group is not G.SCHEDULE:
            by_group.setdefault(change.group, []).append(change)

    def listed(group: ChangeGroup) -> str:
        return "; ".join(c.describe() for c in by_group[group])

    refusals, warnings = [], []
    if G.OPTIMIZER_STATE in by_group and not exclude_optimizer:
        refusals.append(
            f"{where}: written with another optimizer state ({listed(G.OPTIMIZER_STATE)}); "
            "resume with the checkpoint's values, or set checkpoint.exclude_from_loading="
            '["optimizer"] to continue with a fresh optimizer (weights, data position and step '
            "are kept)"
        )
    elif G.OPTIMIZER_STATE in by_group:  # excluded: a fresh optimizer for the changed one
        warnings.append(
            f"resuming {where} with a fresh optimizer (checkpoint.exclude_from_loading): "
            f"{listed(G.OPTIMIZER_STATE)}"
        )
    keep = False
    if G.SCHEDULE in by_group:
        if schedule_from is None:
            refusals.append(
                f"{where}: written with another LR schedule ({listed(G.SCHEDULE)}); set "
                'checkpoint.schedule_from="checkpoint" to keep the recorded schedule, or "config" '
                f"to switch to this one from step {step}"
            )
        elif schedule_from is ScheduleSource.CHECKPOINT:
            keep = True
            warnings.append(
                f"keeping {where}'s LR schedule (checkpoint.schedule_from): the configured "
                f"change is ignored ({listed(G.SCHEDULE)})"
            )
        else:
            warnings.append(
                f"switching to the configured LR schedule at step {step} "
                f"(checkpoint.schedule_from): {listed(G.SCHEDULE)}"
            )
    if G.NUMERICS in by_group:
        warnings.append(
            f"resuming {where} under other training numerics (the run is no longer the "
            f"uninterrupted one bit for bit): {listed(G.NUMERICS)}"
        )
    fresh = exclude_optimizer and G.OPTIMIZER_STATE in by_group
    return ChangeVerdict(tuple(refusals), tuple(warnings), fresh, keep)
