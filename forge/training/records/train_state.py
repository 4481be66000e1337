"""The JSON train state saved beside the tensors, with a schema: a resume structures it
strictly (cattrs) *before* loading any tensor, so a checkpoint whose train state has the wrong
shape is skipped like a truncated one instead of half-loading the model."""

from __future__ import annotations

from typing import Any

import attrs
from cattrs.errors import ClassValidationError, IterableValidationError

from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.policy import step_of
from forge.checkpoint.store import TRAIN_STATE, CheckpointError
from forge.config.loader import CONVERTER, ConfigError, leaf_errors
from forge.training.loop.plan import SaveReason
from forge.types import LoopState

TRAIN_STATE_VERSION = 2  # 2: the loader's position in global rows, free of the layout
# Keys that older train states carry and this one no longer reads: dropped before structuring,
# so that their checkpoints still resume (``identity`` compares the model since it was added).
RETIRED_KEYS = ("model_fingerprint",)


@attrs.frozen
class LoaderRecord:
    """The loader's position, free of the layout (``forge.data.loader.LoaderState``): global
    rows consumed, data steps completed, rows into the unfinished step, each source's cursor,
    and the digest of the rows consumed."""

    rows: int
    steps: int
    step_rows: int
    cursors: tuple[int, ...]
    digest: str


class EarlierLoaderError(ConfigError):
    """A checkpoint whose loader position counts micro-batches: its sample order depended on
    the split of a step, which this forge's does not, so it cannot be continued exactly."""


@attrs.frozen
class ScheduleRecord:
    name: str
    warmup_steps: int
    decay_steps: int
    total_steps: int


@attrs.frozen
class TrainState:
    """Everything but tensors that a resume restores or checks."""

    format_version: int
    step: int
    tokens_seen: int
    reason: SaveReason
    loop_state: LoopState
    loader: LoaderRecord
    schedule: ScheduleRecord
    world_size: int
    identity: dict[str, Any] | None = None  # forge.training.records.run_record.run_identity
    # forge.training.records.run_record.recorded_settings: the optimizer, numerics and schedule
    settings: dict[str, Any] | None = None


def train_state_to_json(state: TrainState) -> dict[str, Any]:
    return CONVERTER.unstructure(state)


def parse_train_state(raw: Any, path: CheckpointPath) -> TrainState:
    """Structure ``raw`` strictly; a ``CheckpointError`` naming the first bad field otherwise."""
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if k not in RETIRED_KEYS}
        loader = raw.get("loader")
        if isinstance(loader, dict) and "micro_batch" in loader:
            raise EarlierLoaderError(
                f"{path / TRAIN_STATE}: written by an earlier forge, whose data order depended "
                "on how a step was split (its loader counts micro-batches); this forge cannot "
                "continue that order exactly: start the run afresh (checkpoint.load_path can "
                "take its weights)"
            )
    try:
        state = CONVERTER.structure(raw, TrainState)
    except (ClassValidationError, IterableValidationError) as exc:
        key, message = leaf_errors(exc, "")[0]
        raise CheckpointError(
            f"{path / TRAIN_STATE}: train state field '{key}' is invalid ({message})"
        ) from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / TRAIN_STATE}: not a train state ({exc})") from None
    if state.step != state.loop_state.step:
        raise CheckpointError(
            f"{path / TRAIN_STATE}: step {state.step} disagrees with its loop state "
            f"({state.loop_state.step})"
        )
    folder_step = step_of(path.name)
    if folder_step is not None and folder_step != state.step:
        raise CheckpointError(
            f"{path / TRAIN_STATE}: step {state.step}, but the checkpoint is {path.name}"
        )
    return state
