"""What a checkpoint records of the run that wrote it, to compare a resume against
(``forge.training.records.resume_rules`` says what a difference means).

- ``run_identity``: the model it trains and the order it reads its data in — a different one
  would not continue the run, so it is refused unless ``checkpoint.allow_config_change``. A
  different *layout* of the same global batch is the same run: only the global batch is
  recorded.
- ``recorded_settings``: the optimizer-state and numerics keys as configured, and the schedule
  as it runs (its peak LR and resolved shape).

Everything is recorded as JSON values (``resume_rules.plain``). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from forge.config.sections import FreezeRule, JobConfig, ModelConfig, ScheduleName
from forge.training.records.resume_rules import (
    DECAY,
    FREEZE_ENTRIES,
    GLOBAL_BATCH,
    IDENTITY,
    MOE_TOKENS,
    TOTAL,
    ChangeGroup,
    config_keys,
    group_of,
    plain,
)

if TYPE_CHECKING:  # a type only: this module records plain values
    from forge.optim.schedules import Schedule


def run_identity(
    config: JobConfig, dp_size: int | None, fingerprints: Sequence[str] | None = None
) -> dict[str, Any]:
    """The values a resumed run must share with its checkpoint (the keys of the identity
    groups), as JSON values.

    Sources are named by name, weight and (with ``fingerprints``, one per source) what their
    dataset holds, never by path: a moved copy of the data is the same run. ``dp_size`` None
    leaves out the global batch (which depends on the world size): the form compared against
    a run directory's ``config.toml``.
    """
    train, data = config.train, config.data
    # latent attention has no key/value heads of its own: a run recorded with them (before
    # [model.mla] refused them) is the same model without them
    unused = {"model.n_kv_heads", "model.head_dim"} if config.model.mla is not None else set()
    identity: dict[str, Any] = {
        f"model.{f.name}": plain(getattr(config.model, f.name))
        for f in attrs.fields(type(config.model))
        if group_of(f"model.{f.name}") in IDENTITY and f"model.{f.name}" not in unused
    }
    identity |= {
        "train.seq_len": train.seq_len,
        "train.seed": train.seed,
        "train.data_seed": train.effective_data_seed,
        "data.train_split": data.train_split,
        "data.sources": [
            {"name": s.name, "weight": s.weight}
            | ({"dataset": fingerprints[i]} if fingerprints else {})
            for i, s in enumerate(data.source_list)
        ],
        "data.temperature": data.temperature,
        "data.phases": plain(data.phases),
        "data.pack_documents": data.pack_documents,
    }
    # each [[freeze]] entry on its own, so that a refusal names the differing ones
    identity[FREEZE_ENTRIES] = len(config.freeze)
    identity |= {f"freeze[{i}]": plain(rule) for i, rule in enumerate(config.freeze)}
    if dp_size is not None:
        groups = config.fault_tolerance.active_groups  # replica groups share the step
        identity[GLOBAL_BATCH] = train.batch_size * dp_size * train.grad_accum_steps * groups
    return identity


def recorded_freeze(recorded: Mapping[str, Any]) -> tuple[FreezeRule, ...] | None:
    """The ``[[freeze]]`` entries a checkpoint's identity recorded (None when it predates
    them, or when they do not read back as entries)."""
    count = recorded.get(FREEZE_ENTRIES)
    if not isinstance(count, int):
        return None
    try:
        return tuple(FreezeRule(**recorded[f"freeze[{i}]"]) for i in range(count))
    except (KeyError, TypeError):  # a hand-edited train state: the config's schedule is used
        return None


def predated_model_defaults() -> dict[str, Any]:
    """Each ``model.*`` identity key's default, as ``run_identity`` records it: what a
    checkpoint from before the key was built with (no ``rope_scaling``, ``head_dim`` from
    ``dim / n_heads``)."""
    return {
        f"model.{f.name}": plain(f.default)
        for f in attrs.fields(ModelConfig)
        if group_of(f"model.{f.name}") in IDENTITY and not isinstance(f.default, attrs.Factory)  # type: ignore[arg-type]
    }


# optimizer keys an optimizer ignores (by optimizer.name): a change of one is no change
UNUSED_BY: dict[str, frozenset[str]] = {
    "adamw": frozenset({"optimizer.momentum", "optimizer.ns_steps"}),
    "schedule_free_adamw": frozenset({"optimizer.momentum", "optimizer.ns_steps"}),
    "lion": frozenset({"optimizer.eps", "optimizer.momentum", "optimizer.ns_steps"}),
    "muon": frozenset(),
}


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


def unused_settings(config: JobConfig) -> frozenset[str]:
    """The settings ``config`` gives no effect, so that a change of one is no change: the
    optimizer's keys it ignores (``UNUSED_BY``), the multi-token loss's weight without
    multi-token depths."""
    unused = UNUSED_BY.get(config.optimizer.name.value, frozenset())
    return unused | ({"train.mtp_loss_weight"} if config.model.mtp_depth == 0 else frozenset())


def recorded_settings(
    config: JobConfig, peak_lr: float, name: ScheduleName, warmup: int, decay: int,
    min_ratio: float, total: int,
) -> dict[str, Any]:  # fmt: skip
    """What a checkpoint records beyond the run's identity: the optimizer-state and numerics
    keys as configured, the schedule as it runs (its peak LR and its resolved shape,
    ``schedule_shape``), and a mixture-of-experts model's tokens per micro-batch (its
    balancing loss and capacity are functions of them)."""
    unused = unused_settings(config)
    groups = (ChangeGroup.OPTIMIZER_STATE, ChangeGroup.NUMERICS)
    settings = {
        key: plain(getattr(getattr(config, key.split(".")[0]), key.split(".")[1]))
        for key in config_keys()
        if group_of(key) in groups and key not in unused
    }
    if config.model.moe:
        train = config.train
        settings[MOE_TOKENS] = train.batch_size * train.seq_len // config.distributed.cp
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
