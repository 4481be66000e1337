"""What makes a run the same run: the model it trains and the order it reads its data in.

A checkpoint records the run's identity; resuming compares it with the config. A different
model, or a different data order (sequence length, global batch, sources, seeds), would not
continue the run bit-for-bit, so it is refused unless ``checkpoint.allow_config_change``. A
different *layout* of the same global batch (2 ranks × batch 4 → 1 rank × batch 8) is the
same run. No torch here: every decision is table-tested.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from forge.config.sections import FreezeRule, JobConfig, ModelConfig


class DifferenceKind(enum.Enum):
    MODEL = "model"  # the architecture or its initialisation
    DATA_ORDER = "data order"  # which tokens each step sees
    FREEZE = "freeze schedule"  # which parameters train when


@attrs.frozen
class Difference:
    """One key whose recorded value differs from the config's."""

    key: str
    recorded: Any
    current: Any
    kind: DifferenceKind

    def describe(self) -> str:
        return f"{self.key}: {self.recorded!r} in the checkpoint, {self.current!r} now"


def _plain(value: Any) -> Any:
    """Enums by value, tuples as lists, attrs classes as dicts: what JSON gives back."""
    if isinstance(value, enum.Enum):
        return value.value
    if attrs.has(type(value)):
        return {k: _plain(v) for k, v in attrs.asdict(value, recurse=False).items()}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# model keys that choose how the model is computed, not what it computes: a resume may
# change them (``config_changes`` groups them with the numerics)
KERNELS = frozenset({"attention"})


def run_identity(
    config: JobConfig, dp_size: int | None, fingerprints: Sequence[str] | None = None
) -> dict[str, Any]:
    """The keys a resumed run must share with its checkpoint, as JSON values.

    Sources are named by name, weight and (with ``fingerprints``, one per source) what their
    dataset holds, never by path: a moved copy of the data is the same run. ``dp_size`` None
    leaves out the global batch (which depends on the world size): the form compared against
    a run directory's ``config.toml``.
    """
    train, data = config.train, config.data
    identity: dict[str, Any] = {
        f"model.{f.name}": _plain(getattr(config.model, f.name))
        for f in attrs.fields(type(config.model))
        if f.name not in KERNELS
    }
    identity |= {
        "train.seq_len": train.seq_len,
        "train.seed": train.seed,
        "train.data_seed": train.effective_data_seed,
        "data.sources": [
            {"name": s.name, "weight": s.weight}
            | ({"dataset": fingerprints[i]} if fingerprints else {})
            for i, s in enumerate(data.source_list)
        ],
        "data.train_split": data.train_split,
        "data.temperature": data.temperature,
        "data.phases": _plain(data.phases),
        "data.pack_documents": data.pack_documents,
    }
    # each [[freeze]] entry on its own, so that a refusal names the differing ones
    identity["freeze (entries)"] = len(config.freeze)
    identity |= {f"freeze[{i}]": _plain(rule) for i, rule in enumerate(config.freeze)}
    if dp_size is not None:
        identity["global batch (train.batch_size × data-parallel size × grad_accum_steps)"] = (
            train.batch_size * dp_size * train.grad_accum_steps
        )
    return identity


def recorded_freeze(recorded: Mapping[str, Any]) -> tuple[FreezeRule, ...] | None:
    """The ``[[freeze]]`` entries a checkpoint's identity recorded (None when it predates
    them, or when they do not read back as entries)."""
    count = recorded.get("freeze (entries)")
    if not isinstance(count, int):
        return None
    try:
        return tuple(FreezeRule(**recorded[f"freeze[{i}]"]) for i in range(count))
    except (KeyError, TypeError):  # a hand-edited train state: the config's schedule is used
        return None


def identity_differences(
    recorded: Mapping[str, Any], current: Mapping[str, Any]
) -> list[Difference]:
    """Every key of ``current`` whose recorded value differs. A model key a checkpoint
    predates is compared with its default (what the older code built: no ``rope_scaling``,
    ``head_dim`` from ``dim / n_heads``); other keys it predates are not compared."""
    predated = predated_model_defaults()
    return [
        Difference(key, earlier, value, difference_kind(key))
        for key, value in current.items()
        for earlier in ([recorded[key]] if key in recorded else [predated.get(key, value)])
        if _plain(earlier) != value
    ]


def predated_model_defaults() -> dict[str, Any]:
    """Each ``model.*`` identity key's default, as ``run_identity`` records it."""
    return {
        f"model.{f.name}": _plain(f.default)
        for f in attrs.fields(ModelConfig)
        if f.name not in KERNELS and not isinstance(f.default, attrs.Factory)  # type: ignore[arg-type]
    }


def difference_kind(key: str) -> DifferenceKind:
    """What an identity key is about."""
    if key.startswith("model."):
        return DifferenceKind.MODEL
    if key.startswith("freeze"):
        return DifferenceKind.FREEZE
    return DifferenceKind.DATA_ORDER


class ResumeVerdict(enum.Enum):
    SAME_RUN = "same run"
    REFUSE = "refuse"  # exit 2, naming every difference
    WARN = "warn"  # resume, listing every difference


def resume_verdict(differences: list[Difference], allow_config_change: bool) -> ResumeVerdict:
    """What a resume does with these differences."""
    if not differences:
        return ResumeVerdict.SAME_RUN
    return ResumeVerdict.WARN if allow_config_change else ResumeVerdict.REFUSE
