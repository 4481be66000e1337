"""Checkpoints: DCP shards for model and optimizer, JSON train state, RNG tensors.

Layout under the checkpoint directory (a local one; an object store's is alike, ``latest``
being a small object naming the step, ``forge.checkpoint.storage``)::

    step_<N>/            .metadata + *.distcp (model, optimizer), train_state.json, rng_rank<r>.pt
    latest -> step_<N>   relative symlink, moved by atomic rename

A save is written to ``step_<N>.tmp`` and renamed when complete; ``latest`` moves after that,
then retention runs. A crash at any instant leaves the previous checkpoint loadable. The
rules that differ between a disk and an object store live in the storage seam; everything here
reads through it.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from forge.checkpoint.integrity import (
    IntegrityError,
    verify_checkpoint,
)
from forge.checkpoint.object_path import ObjectPath
from forge.checkpoint.paths import CheckpointPath, file_sizes
from forge.checkpoint.pins import remove_unless_pinned
from forge.checkpoint.policy import SaveSchedule, retention_plan, step_of
from forge.checkpoint.rng import restore_rng
from forge.checkpoint.safety import (
    UnreadableCheckpointError,
    load_tensors_safely,
    read_metadata_safely,
)
from forge.checkpoint.storage import TRAIN_STATE, step_dir, storage_of
from forge.config.checkpoint import Verification
from forge.errors import UserInputError, one_line
from forge.model.transformer import canonical_name

# Optimizer state and param-group settings keyed by parameter name, not by group index: each
# pipeline stage then contributes distinct keys, and a checkpoint re-splits at any layout.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(UserInputError):
    """A checkpoint cannot be used: missing, incomplete or not matching the model."""


class ShapeMismatchError(CheckpointError):
    """The checkpoint was written for another model configuration."""


SINGLE_PROCESS_WARNING = ".*torch.distributed is disabled.*"


@contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def ignore_single_process_warning() -> None:
    """The same, for the rest of the process: an async save's write runs in DCP's thread and
    can warn once ``single_process_dcp`` has ended (a slow store's upload did, every save)."""
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)


def is_complete(path: CheckpointPath) -> bool:
    """Committed: on a disk, DCP's ``.metadata`` (written last by DCP) and the train state
    (written after DCP returns); in an object store, the marker written last at commit."""
    return storage_of(path).is_complete(path)


def list_steps(root: CheckpointPath) -> list[int]:
    """Steps of the checkpoints a reader may consider, ascending: every ``step_<N>``
    directory on a disk (complete or not), the committed ones in an object store."""
    return storage_of(root).list_steps(root)


def latest_step(root: CheckpointPath) -> int | None:
    """Step the ``latest`` pointer names, if it exists."""
    target = storage_of(root).latest_target(root)
    return None if target is None else step_of(target)


def newest_complete(root: CheckpointPath) -> CheckpointPath | None:
    """The checkpoint to resume from: the newest complete step. ``latest`` names it too,
    unless a commit was cut between making the step and moving the pointer, or someone moved
    the pointer back; either way the newest committed work wins (``resolve_resume`` says
    so), and no newer checkpoint is later overwritten."""
    for step in reversed(list_steps(root)):
        if is_complete(step_dir(root, step)):
            return step_dir(root, step)
    return None


def commit_checkpoint(
    root: CheckpointPath,
    tmp: CheckpointPath,
    step: int,
    train_state: dict[str, Any],
    checksums: dict[str, list] | None = None,
) -> CheckpointPath:
    """Rank 0, once every rank's shards are in ``tmp``: write the train state and the
    checksum record (``checksums``, what the ranks measured of their files, completed with
    the rest), make ``tmp`` checkpoint ``step`` and point ``latest`` at it (the storage's one
    commit function)."""
    return storage_of(root).commit(root, tmp, step, train_state, checksums or {})


def save_model_only(
    root: CheckpointPath, step: int, model: nn.Module, train_state: dict[str, Any]
) -> CheckpointPath:
    """A model-only checkpoint ``root/step_<step>`` (one process), usable as ``load_path``."""
    storage = storage_of(root)
    tmp = storage.staging(root, step)
    storage.prepare(root, tmp)
    with single_process_dcp():
        dcp_save({"model": model.state_dict()}, storage_writer=storage.writer(tmp, None))
    return commit_checkpoint(root, tmp, step, train_state)


def remove_stale_temporaries(root: CheckpointPath) -> list[str]:
    """Remove what a crashed save left (``step_<N>.tmp`` folders and ``latest.tmp`` on a
    disk, uncommitted ``step_<N>/`` prefixes in an object store; call at start-up, when no
    save can be in flight); returns their names."""
    return storage_of(root).remove_stale(root)


def apply_retention(
    root: CheckpointPath,
    keep_last_n: int,
    schedule: SaveSchedule,
    clock: Callable[[], float] = time.time,
) -> list[int]:
    """Delete what ``retention_plan`` names, except the steps a reader has pinned (they are
    deferred: ``forge.checkpoint.pins``); returns the deleted steps."""
    steps = list_steps(root)
    complete = [s for s in steps if is_complete(step_dir(root, s))]
    incomplete = [s for s in steps if s not in complete]
    doomed = retention_plan(complete, keep_last_n, latest_step(root), schedule, None, incomplete)
    return [step for step in doomed if remove_unless_pinned(root, step, clock())]


def read_train_state(path: CheckpointPath) -> dict[str, Any]:
    """The JSON train state of a checkpoint directory (a JSON object; its fields are checked
    by whoever reads them)."""
    try:
        raw = json.loads((path / TRAIN_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / TRAIN_STATE}: unreadable train state ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / TRAIN_STATE}: not a JSON object")
    return raw


def load_checkpoint(
    path: CheckpointPath,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    rank: int = 0,
    restore_rng_state: bool = True,
    verify: Verification = Verification.FULL,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Load model (and optimizer) state in place, after ``check_loadable`` (``verify``: how
    much of its bytes); returns the train state. Never unpickles code. ``say`` gets the
    warning when the saved GPU random state does not fit the GPUs visible now."""
    check_loadable(path, model, verify)
    if optimizer is None:
        state: dict[str, Any] = {"model": model.state_dict()}
        _dcp_load(state, path)
        model.load_state_dict(state["model"])
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        state = {"model": model_sd, "optimizer": optim_sd}
        _dcp_load(state, path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=STATE_DICT_OPTIONS,
        )
    rng_file = path / f"rng_rank{rank}.pt"
    if restore_rng_state and rng_file.is_file():
        restore_rng(load_tensors_safely(rng_file), say)
    return read_train_state(path)


def check_loadable(
    path: CheckpointPath, model: nn.Module, verify: Verification = Verification.FULL
) -> None:
    """Raise ``CheckpointError`` unless every file of ``path`` reads and fits ``model``: complete,
    DCP metadata safe and readable, every shard file as long as the metadata says, the train
    state a JSON object, every rank's RNG file a tensor file, its bytes those recorded at
    commit (``verify_checkpoint``: lengths, and checksums under ``Verification.FULL``), and
    the shapes the model's. Nothing is loaded into the model before this passes."""
    if (odd := special_file(path)) is not None:  # opening a FIFO would wait for a writer
        raise CheckpointError(f"{odd}: not a regular file (a FIFO, device or socket)")
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no .metadata or {TRAIN_STATE})")
    try:
        meta = read_metadata_safely(path)
        _check_shard_sizes(path, meta)
        read_train_state(path)
        for rng_file in sorted(path.glob("rng_rank*.pt"), key=str):
            rng = load_tensors_safely(rng_file)
            if not isinstance(rng, dict) or not {"torch_cpu", "python"} <= rng.keys():
                raise CheckpointError(f"{rng_file}: not an RNG state file")
        # after the safe reads: a file carrying code is refused as unsafe, never skipped
        if not verify_checkpoint(path, verify) and "settings" in read_train_state(path):
            raise CheckpointError(  # a forge that records settings records checksums too
                f"{path}: its checksums.json is missing (recorded at every commit); the "
                "checkpoint is incomplete or damaged"
            )
    except (UnreadableCheckpointError, IntegrityError) as exc:
        raise CheckpointError(exc.lines) from None
    _check_shapes(path, model, meta)


def special_file(path: CheckpointPath) -> CheckpointPath | None:
    """The first entry of a local checkpoint folder that is neither a regular file nor a
    folder (symbolic links followed), or None; an object store holds none."""
    if isinstance(path, ObjectPath):
        return None
    try:
        entries = sorted(path.iterdir())
    except OSError:  # gone (retention raced the reader) or unreadable: the reads name it
        return None
    return next((f for f in entries if not (f.is_file() or f.is_dir())), None)


def _check_shard_sizes(path: CheckpointPath, meta: Metadata) -> None:
    """Every byte range the metadata names lies inside its file (a truncated shard fails here,
    before DCP has written half of the model)."""
    needed: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    present = file_sizes(path)
    for name, end in needed.items():
        shard = path / name
        size = present.get(name, -1)
        if size < end:
            what = "is missing" if size < 0 else f"holds {size} bytes, the metadata names {end}"
            raise CheckpointError(f"{shard}: {what} (truncated or incomplete checkpoint)")


def read_tensors(
    state: dict[str, Any], path: CheckpointPath, process_group: dist.ProcessGroup | None = None
) -> None:
    """Fill ``state`` (a ``{"model": ..., "optimizer": ...}`` template) from checkpoint ``path``."""
    _dcp_load(state, path, process_group)


def _dcp_load(
    state: dict[str, Any], path: CheckpointPath, process_group: dist.ProcessGroup | None = None
) -> None:
    try:
        with single_process_dcp():
            reader = storage_of(path).reader(path)
            dcp_load(state, storage_reader=reader, process_group=process_group)
    except BaseException as exc:  # DCP's CheckpointException is not an Exception
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(f"{path}: DCP load failed ({one_line(exc)})") from None


def _check_shapes(path: CheckpointPath, model: nn.Module, meta: Metadata) -> None:
    """One line naming the first parameter whose saved shape differs from the model's."""
    saved = {
        k.removeprefix("model."): tuple(v.size)
        for k, v in meta.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    for raw_name, tensor in model.state_dict().items():
        name = canonical_name(raw_name)
        if name not in saved:
            raise ShapeMismatchError(f"{path}: has no parameter '{name}'; the model config differs")
        if saved[name] != tuple(tensor.shape):
            raise ShapeMismatchError(
                f"{path}: '{name}' has shape {list(saved[name])} in the checkpoint but "
                f"{list(tensor.shape)} in the model; match the [model] config to the checkpoint"
            )
