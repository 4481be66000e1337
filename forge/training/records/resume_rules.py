"""What a changed config means for a resume: one table (every config key belongs to one
group), one difference record (``Change``), one verdict (``change_verdict``). No torch here:
the table and every decision are table-tested. What a checkpoint records to compare against is
``forge.training.records.run_record``.

- Run identity — ``MODEL`` (the architecture and its initialisation), ``DATA_ORDER`` (the data,
  its split, order and seeds, sequence length, packing, the global batch) and ``FREEZE`` (the
  ``[[freeze]]`` schedule): another run; refused, or with ``checkpoint.allow_config_change``
  continued with a warning naming every difference.
- ``OPTIMIZER_STATE`` (the optimizer and the hyper-parameters it uses, ``train.param_dtype``):
  the saved state belongs to another optimizer; refused, never reported as damage;
  ``checkpoint.exclude_from_loading = ["optimizer"]`` continues with a fresh optimizer (only
  when they changed: a requeued run with the key still set keeps its optimizer state).
- ``SCHEDULE`` (``optimizer.lr``, ``[scheduler]``, and ``train.max_steps`` where the decay
  depends on it): refused, naming the keys; ``checkpoint.schedule_from = "checkpoint"`` keeps
  the recorded schedule, ``"config"`` switches to the new one at the resume step.
- ``NUMERICS`` (compute precision, clipping, the z-loss, a kernel, compilation, the loss's
  chunks; a mixture-of-experts model's tokens per micro-batch): the same state continues
  under other arithmetic; accepted with a warning (the run is no longer the uninterrupted
  one bit for bit).
- ``LAYOUT`` (``train.batch_size`` and ``grad_accum_steps`` at the same global batch, every
  parallel degree, loader workers): free *because* the resume is exact — every split of a step
  reads the same rows (``forge.data.loader``), ``tests/distributed/test_any_layout_resume.py``.
- ``FREE`` (logging, evaluation, checkpointing, hooks, the profiler, the run's machine): accepted
  without a word.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from forge.config.sections import JobConfig, ScheduleSource


class ChangeGroup(enum.Enum):
    """What a change of a config key means for a resume."""

    MODEL = "model"
    DATA_ORDER = "data order"
    FREEZE = "freeze schedule"
    OPTIMIZER_STATE = "optimizer state"
    SCHEDULE = "LR schedule"
    NUMERICS = "training numerics"
    LAYOUT = "layout"
    FREE = "free"


G = ChangeGroup
IDENTITY = frozenset({G.MODEL, G.DATA_ORDER, G.FREEZE})  # another run

# recorded values that are no config key of their own
# × fault_tolerance.groups under in-job recovery; the name is the record's key: kept
GLOBAL_BATCH = "global batch (train.batch_size × data-parallel size × grad_accum_steps)"
DECAY = "decay steps (scheduler.decay_steps or train.max_steps)"
TOTAL = "total steps (train.max_steps)"
MOE_TOKENS = "tokens per micro-batch (train.batch_size × train.seq_len / distributed.cp)"
FREEZE_ENTRIES = "freeze (entries)"

# The one table. A section's entry is the group of each of its keys; a key's own entry is an
# exception to its section's (never a repeat of it: tested).
GROUPS: dict[str, ChangeGroup] = {
    # sections
    "run": G.FREE,
    "model": G.MODEL,
    "scheduler": G.SCHEDULE,
    "eval": G.FREE,
    "checkpoint": G.FREE,
    "metrics": G.FREE,
    "resilience": G.FREE,
    "distributed": G.LAYOUT,
    "fault_tolerance": G.FREE,  # where the lighthouse is, timeouts
    "hooks": G.FREE,
    "profiler": G.FREE,
    "freeze": G.FREEZE,
    # keys of sections that mix groups
    "model.attention": G.NUMERICS,  # another kernel for the same function
    "train.batch_size": G.LAYOUT,  # the global batch is DATA_ORDER (GLOBAL_BATCH)
    "train.seq_len": G.DATA_ORDER,
    "train.max_steps": G.SCHEDULE,  # through the resolved schedule (decay, WSD's tail)
    "train.max_epochs": G.FREE,
    "train.grad_accum_steps": G.LAYOUT,
    "train.grad_clip_norm": G.NUMERICS,
    "train.seed": G.DATA_ORDER,  # the initialisation and, unless data_seed is set, the order
    "train.data_seed": G.DATA_ORDER,
    "train.mixed_precision": G.NUMERICS,
    "train.param_dtype": G.OPTIMIZER_STATE,
    "train.num_threads": G.FREE,
    "train.activation_checkpointing": G.FREE,
    "train.compile": G.NUMERICS,  # inductor's fused kernels round otherwise than eager's
    "train.z_loss_weight": G.NUMERICS,
    "train.mtp_loss_weight": G.NUMERICS,
    "train.float8": G.NUMERICS,  # the checkpoint holds high-precision weights either way
    "train.deterministic": G.FREE,
    "train.float8_check": G.FREE,  # a guard: it changes no applied step's numerics
    "train.float8_check_tolerance": G.FREE,
    "train.float8_check_grad_tolerance": G.FREE,
    "train.float8_on_drift": G.FREE,
    "train.loss_chunk_size": G.NUMERICS,  # the loss and its gradient summed in other parts
    "optimizer.name": G.OPTIMIZER_STATE,
    "optimizer.lr": G.SCHEDULE,
    "optimizer.weight_decay": G.OPTIMIZER_STATE,  # the saved param groups carry it
    "optimizer.betas": G.OPTIMIZER_STATE,
    "optimizer.eps": G.OPTIMIZER_STATE,
    "optimizer.decay_embeddings": G.OPTIMIZER_STATE,  # which group each parameter is in
    "optimizer.momentum": G.OPTIMIZER_STATE,
    "optimizer.ns_steps": G.OPTIMIZER_STATE,
    "data.path": G.DATA_ORDER,  # through its dataset's fingerprint
    "data.train_split": G.DATA_ORDER,
    "data.eval_split": G.FREE,
    "data.verify_checksum": G.FREE,
    "data.sources": G.DATA_ORDER,
    "data.temperature": G.DATA_ORDER,
    "data.phases": G.DATA_ORDER,
    "data.pack_documents": G.DATA_ORDER,
    "data.num_workers": G.LAYOUT,
    "distributed.backend": G.FREE,
    "distributed.timeout_s": G.FREE,
    "fault_tolerance.enabled": G.LAYOUT,  # the global batch split among replica groups
    "fault_tolerance.groups": G.LAYOUT,
    "fault_tolerance.group": G.LAYOUT,
    # recorded values that are no key
    GLOBAL_BATCH: G.DATA_ORDER,
    DECAY: G.SCHEDULE,
    TOTAL: G.SCHEDULE,
    MOE_TOKENS: G.NUMERICS,
    FREEZE_ENTRIES: G.FREEZE,
}
DERIVED = (GLOBAL_BATCH, DECAY, TOTAL, MOE_TOKENS, FREEZE_ENTRIES)


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
    """The group of a config key or recorded value (its own entry, else its section's;
    ``freeze[i]`` is the freeze section's)."""
    if key in GROUPS:
        return GROUPS[key]
    return GROUPS[key.split(".")[0].split("[")[0]]


def plain(value: Any) -> Any:
    """Enums by value, tuples as lists, attrs classes and mappings as dicts: what JSON gives
    back, so that a recorded value and a current one compare alike."""
    if isinstance(value, enum.Enum):
        return value.value
    if attrs.has(type(value)):
        return {k: plain(v) for k, v in attrs.asdict(value, recurse=False).items()}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


@attrs.frozen
class Change:
    """One recorded value that differs from the config's, with its group."""

    key: str
    recorded: Any
    current: Any
    group: ChangeGroup

    def describe(self) -> str:
        return f"{self.key}: {self.recorded!r} → {self.current!r}"


def changes(
    recorded: Mapping[str, Any],
    current: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> list[Change]:
    """Every value of ``current`` whose recorded one differs, in ``current``'s order. A key
    the record predates is compared with its entry in ``defaults`` (what the older code
    built), and not compared when it has none: an older checkpoint cannot say."""
    found = []
    for key, value in current.items():
        if key in recorded:
            earlier = recorded[key]
        elif defaults is not None and key in defaults:
            earlier = defaults[key]
        else:
            continue
        if plain(earlier) != plain(value):
            found.append(Change(key, plain(earlier), plain(value), group_of(key)))
    return found


@attrs.frozen
class ChangeOptions:
    """What the ``[checkpoint]`` section says to do about changes."""

    allow_config_change: bool = False  # continue another run's checkpoint, with a warning
    exclude_optimizer: bool = False  # exclude_from_loading = ["optimizer"]
    schedule_from: ScheduleSource | None = None


@attrs.frozen
class ChangeVerdict:
    """What a resume does about the changes: refuse (one line per refused kind), or go on
    with these warnings, a fresh optimizer or the recorded schedule."""

    refusals: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    fresh_optimizer: bool = False
    keep_schedule: bool = False


def change_verdict(
    found: list[Change], where: str, step: int, options: ChangeOptions, trains: bool = True
) -> ChangeVerdict:
    """The verdict on ``found`` for the checkpoint ``where`` of step ``step``. A resume that
    ``trains`` no step (already complete) follows no schedule: its schedule changes do not
    matter. Layout and free keys are never in it."""
    by_group: dict[ChangeGroup, list[Change]] = {}
    for change in found:
        if trains or change.group is not G.SCHEDULE:
            by_group.setdefault(change.group, []).append(change)

    def listed(*groups: ChangeGroup) -> str:
        return "; ".join(c.describe() for g in groups for c in by_group.get(g, ()))

    refusals, warnings = identity_verdict(by_group, where, options.allow_config_change)
    if G.OPTIMIZER_STATE in by_group and not options.exclude_optimizer:
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
        if options.schedule_from is None:
            refusals.append(
                f"{where}: written with another LR schedule ({listed(G.SCHEDULE)}); set "
                'checkpoint.schedule_from="checkpoint" to keep the recorded schedule, or "config" '
                f"to switch to this one from step {step}"
            )
        elif options.schedule_from is ScheduleSource.CHECKPOINT:
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
    fresh = options.exclude_optimizer and G.OPTIMIZER_STATE in by_group
    return ChangeVerdict(tuple(refusals), tuple(warnings), fresh, keep)


def identity_verdict(
    by_group: Mapping[ChangeGroup, list[Change]], where: str, allow: bool
) -> tuple[list[str], list[str]]:
    """The refusal (one line naming every difference) or, with ``allow``, the warnings (one
    per difference) for a changed run identity."""
    found = [c for g in ChangeGroup if g in IDENTITY for c in by_group.get(g, ())]
    if not found:
        return [], []
    if allow:
        return [], [
            f"resuming {where} with a different {c.group.value}: {c.describe()}" for c in found
        ]
    kinds = " and ".join(g.value for g in ChangeGroup if g in IDENTITY and g in by_group)
    return [
        f"{where}: written with a different {kinds} (the checkpoint's → this config's): "
        f"{'; '.join(c.describe() for c in found)}; resume with the checkpoint's values, or "
        "set checkpoint.allow_config_change=true to continue anyway"
    ], []
