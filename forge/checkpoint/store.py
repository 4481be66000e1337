"""On-disk checkpoints: DCP shards for model and optimizer, JSON train state, RNG tensors.

Layout under the checkpoint directory::

    step_<N>/            .metadata + *.distcp (model, optimizer), train_state.json, rng_rank<r>.pt
    latest -> step_<N>   relative symlink, moved by atomic rename

A save is written to ``step_<N>.tmp`` and renamed when complete; ``latest`` moves after that,
then retention runs. A crash at any instant leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
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
    write_checksums,
)
from forge.checkpoint.policy import SaveSchedule, retention_plan, step_of
from forge.checkpoint.rng import restore_rng
from forge.checkpoint.safety import (
    UnreadableCheckpointError,
    load_tensors_safely,
    read_metadata_safely,
)
from forge.config.checkpoint import Verification
from forge.errors import UserInputError, one_line
from forge.model.transformer import canonical_name

TRAIN_STATE = "train_state.json"
# Optimizer state and param-group settings keyed by parameter name, not by group index: each
# pipeline stage then contributes distinct keys, and a checkpoint re-splits at any layout.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
LATEST = "latest"


class CheckpointError(UserInputError):
    """A checkpoint cannot be used: missing, incomplete or not matching the model."""


class ShapeMismatchError(CheckpointError):
    """The checkpoint was written for another model configuration."""


@contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def step_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / f"step_{step}"


def is_complete(path: pathlib.Path) -> bool:
    """DCP writes ``.metadata`` last and the train state is written after DCP returns."""
    return (path / ".metadata").is_file() and (path / TRAIN_STATE).is_file()


def list_steps(root: pathlib.Path) -> list[int]:
    """Steps of every ``step_<N>`` directory (complete or not), ascending."""
    if not root.is_dir():
        return []
    return sorted(s for p in root.iterdir() if (s := step_of(p.name)) is not None)


def latest_step(root: pathlib.Path) -> int | None:
    """Step the ``latest`` link names, if it exists."""
    link = root / LATEST
    if not link.is_symlink():
        return None
    return step_of(os.readlink(link))


def newest_complete(root: pathlib.Path) -> pathlib.Path | None:
    """The checkpoint to resume from: ``latest`` if complete, else the newest complete step."""
    latest = latest_step(root)
    if latest is not None and is_complete(step_dir(root, latest)):
        return step_dir(root, latest)
    for step in reversed(list_steps(root)):
        if is_complete(step_dir(root, step)):
            return step_dir(root, step)
    return None


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _point_latest(root: pathlib.Path, step: int) -> None:
    tmp = root / f"{LATEST}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(f"step_{step}")
    os.replace(tmp, root / LATEST)


def commit_checkpoint(
    root: pathlib.Path,
    tmp: pathlib.Path,
    step: int,
    train_state: dict[str, Any],
    checksums: dict[str, list] | None = None,
) -> pathlib.Path:
    """Rank 0, once every rank's shards are in ``tmp``: write the train state and the
    checksum record (``checksums``, what the ranks measured of their files, completed with
    the rest), rename ``tmp`` to ``step_<step>`` and move ``latest`` to it."""
    final = step_dir(root, step)
    _write_json(tmp / TRAIN_STATE, train_state)
    write_checksums(tmp, checksums or {})
    if final.exists():  # re-saving a step (e.g. after a resume): keep the new one
        shutil.rmtree(final)
    os.replace(tmp, final)
    _point_latest(root, step)
    return final


def save_model_only(
    root: pathlib.Path, step: int, model: nn.Module, train_state: dict[str, Any]
) -> pathlib.Path:
    """A model-only checkpoint ``root/step_<step>`` (one process), usable as ``load_path``."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = step_dir(root, step), root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with single_process_dcp():
        dcp_save({"model": model.state_dict()}, checkpoint_id=str(tmp))
    _write_json(tmp / TRAIN_STATE, train_state)
    write_checksums(tmp, {})
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _point_latest(root, step)
    return final


def remove_stale_temporaries(root: pathlib.Path) -> list[str]:
    """Delete ``step_<N>.tmp`` folders and ``latest.tmp`` left by a crash (call at start-up,
    when no save can be in flight); returns their names."""
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.endswith(".tmp")]
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return [p.name for p in stale]


def apply_retention(root: pathlib.Path, keep_last_n: int, schedule: SaveSchedule) -> list[int]:
    """Delete what ``retention_plan`` names; returns the deleted steps."""
    steps = list_steps(root)
    complete = [s for s in steps if is_complete(step_dir(root, s))]
    incomplete = [s for s in steps if s not in complete]
    doomed = retention_plan(complete, keep_last_n, latest_step(root), schedule, None, incomplete)
    for step in doomed:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return doomed


def read_train_state(path: pathlib.Path) -> dict[str, Any]:
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
    path: pathlib.Path,
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
    path: pathlib.Path, model: nn.Module, verify: Verification = Verification.FULL
) -> None:
    """Raise ``CheckpointError`` unless every file of ``path`` reads and fits ``model``: complete,
    DCP metadata safe and readable, every shard file as long as the metadata says, the train
    state a JSON object, every rank's RNG file a tensor file, its bytes those recorded at
    commit (``verify_checkpoint``: lengths, and checksums under ``Verification.FULL``), and
    the shapes the model's. Nothing is loaded into the model before this passes."""
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no .metadata or {TRAIN_STATE})")
    try:
        meta = read_metadata_safely(path)
        _check_shard_sizes(path, meta)
        read_train_state(path)
        for rng_file in sorted(path.glob("rng_rank*.pt")):
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


def _check_shard_sizes(path: pathlib.Path, meta: Metadata) -> None:
    """Every byte range the metadata names lies inside its file (a truncated shard fails here,
    before DCP has written half of the model)."""
    needed: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    for name, end in needed.items():
        shard = path / name
        size = shard.stat().st_size if shard.is_file() else -1
        if size < end:
            what = "is missing" if size < 0 else f"holds {size} bytes, the metadata names {end}"
            raise CheckpointError(f"{shard}: {what} (truncated or incomplete checkpoint)")


def read_tensors(
    state: dict[str, Any], path: pathlib.Path, process_group: dist.ProcessGroup | None = None
) -> None:
    """Fill ``state`` (a ``{"model": ..., "optimizer": ...}`` template) from checkpoint ``path``."""
    _dcp_load(state, path, process_group)


def _dcp_load(
    state: dict[str, Any], path: pathlib.Path, process_group: dist.ProcessGroup | None = None
) -> None:
    try:
        with single_process_dcp():
            dcp_load(state, checkpoint_id=str(path), process_group=process_group)
    except BaseException as exc:  # DCP's CheckpointException is not an Exception
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(f"{path}: DCP load failed ({one_line(exc)})") from None


def _check_shapes(path: pathlib.Path, model: nn.Module, meta: Metadata) -> None:
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
