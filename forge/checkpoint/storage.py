"""The storage seam: how a checkpoint is written, committed, found, pointed at and removed.

Two implementations, chosen by the kind of path (``storage_of``):

- ``PosixStorage`` (a local or mounted directory): a save is written to ``step_<N>.tmp`` and
  committed by renaming it to ``step_<N>``; ``latest`` is a relative symlink moved by rename.
- ``ObjectStorage`` (any fsspec URL: ``s3://``, ``gs://``...): no rename, no symlink, so a
  save is written in place under ``step_<N>/`` and committed by writing its marker,
  ``checksums.json``, last (after the train state); ``latest`` is a small object written after
  the commit. A checkpoint without its marker is invisible to every reader and is removed at
  start-up; a step written again loses its marker first. Removal deletes the marker first.

Each commit is one function (``commit``). Everything else reads checkpoints through
``CheckpointPath`` (``forge.checkpoint.paths``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import attrs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from forge.checkpoint.checksum_writer import ChecksummingWriter
from forge.checkpoint.integrity import CHECKSUMS, write_checksums
from forge.checkpoint.object_path import ObjectPath
from forge.checkpoint.paths import CheckpointPath, write_atomically
from forge.checkpoint.policy import step_of

TRAIN_STATE = "train_state.json"
LATEST = "latest"


class Storage(Protocol):
    """What the checkpointer, the resolver and retention need of a place checkpoints live."""

    def staging(self, root: Any, step: int) -> Any:
        """Where a save of ``step`` writes its files before the commit."""
        ...

    def prepare(self, root: Any, staging: Any, fresh: bool = False) -> None:
        """Rank 0, before any rank writes: ``staging`` is ready for a save (``fresh``: no
        checkpoint of this step can exist, as the caller knows)."""
        ...

    def commit(self, root: Any, staging: Any, step: int, train_state: dict, checksums: dict) -> Any:
        """Rank 0, once every rank's files are in ``staging``: make it checkpoint ``step``
        and point ``latest`` at it; returns the committed checkpoint."""
        ...

    def discard(self, staging: Any) -> None:
        """Remove a failed save's files."""
        ...

    def remove(self, path: Any) -> None:
        """Remove a checkpoint (invisible first, then gone)."""
        ...

    def is_complete(self, path: Any) -> bool: ...

    def list_steps(self, root: Any) -> list[int]:
        """The steps of the checkpoints a reader may consider, ascending."""
        ...

    def latest_target(self, root: Any) -> str | None:
        """What ``latest`` names (a folder name), or None when there is none."""
        ...

    def remove_stale(self, root: Any) -> list[str]:
        """Remove what a crashed save left (no save may be in flight); their names."""
        ...

    def writer(self, staging: Any, pool: ThreadPoolExecutor | None) -> FileSystemWriter:
        """DCP's writer into ``staging`` (checksumming shards as written, where it can)."""
        ...

    def reader(self, path: Any) -> FileSystemReader:
        """DCP's reader of checkpoint ``path``."""
        ...


def step_dir(root: CheckpointPath, step: int) -> CheckpointPath:
    return root / f"step_{step}"


def train_state_bytes(train_state: dict[str, Any]) -> bytes:
    return json.dumps(train_state, indent=2).encode("utf-8")


@attrs.frozen
class PosixStorage:
    """A local or mounted directory: rename to commit, a symlink for ``latest``."""

    def staging(self, root: pathlib.Path, step: int) -> pathlib.Path:
        return root / f"step_{step}.tmp"

    def prepare(self, root: pathlib.Path, staging: pathlib.Path, fresh: bool = False) -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()

    def commit(
        self,
        root: pathlib.Path,
        staging: pathlib.Path,
        step: int,
        train_state: dict[str, Any],
        checksums: dict[str, list],
    ) -> pathlib.Path:
        final = root / f"step_{step}"
        write_atomically(staging / TRAIN_STATE, train_state_bytes(train_state))
        write_checksums(staging, checksums)
        if final.exists():  # re-saving a step (e.g. after a resume): keep the new one
            shutil.rmtree(final)
        os.replace(staging, final)
        link = root / f"{LATEST}.tmp"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(final.name)
        os.replace(link, root / LATEST)
        return final

    def discard(self, staging: pathlib.Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def remove(self, path: pathlib.Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def is_complete(self, path: pathlib.Path) -> bool:
        """DCP writes ``.metadata`` last and the train state is written after DCP returns."""
        return (path / ".metadata").is_file() and (path / TRAIN_STATE).is_file()

    def list_steps(self, root: pathlib.Path) -> list[int]:
        """Every ``step_<N>`` directory, complete or not (an incomplete one is damage: a
        save is complete before it is renamed)."""
        if not root.is_dir():
            return []
        return sorted(s for p in root.iterdir() if (s := step_of(p.name)) is not None)

    def latest_target(self, root: pathlib.Path) -> str | None:
        link = root / LATEST
        return os.readlink(link) if link.is_symlink() else None

    def remove_stale(self, root: pathlib.Path) -> list[str]:
        if not root.is_dir():
            return []
        stale = [p for p in root.iterdir() if p.name.endswith(".tmp")]
        for p in stale:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return [p.name for p in stale]

    def writer(self, staging: pathlib.Path, pool: ThreadPoolExecutor | None) -> FileSystemWriter:
        return FileSystemWriter(staging) if pool is None else ChecksummingWriter(staging, pool)

    def reader(self, path: pathlib.Path) -> FileSystemReader:
        return FileSystemReader(path)


@attrs.frozen
class ObjectStorage:
    """An object store through fsspec: the marker written last commits a checkpoint."""

    def staging(self, root: ObjectPath, step: int) -> ObjectPath:
        return root / f"step_{step}"

    def prepare(self, root: ObjectPath, staging: ObjectPath, fresh: bool = False) -> None:
        """An earlier save of this step (unless ``fresh``) loses its marker: no reader sees
        its old record beside the new objects. What it held besides is overwritten, or
        recorded with the new save (DCP reads only the shards its metadata names); what a
        crashed save left goes at start-up (``remove_stale``)."""
        if not fresh:
            (staging / CHECKSUMS).unlink(missing_ok=True)
            (staging / ".metadata").unlink(missing_ok=True)  # else DCP warns it overwrites

    def commit(
        self,
        root: ObjectPath,
        staging: ObjectPath,
        step: int,
        train_state: dict[str, Any],
        checksums: dict[str, list],
    ) -> ObjectPath:
        write_atomically(staging / TRAIN_STATE, train_state_bytes(train_state))
        write_checksums(staging, checksums)  # the marker: last
        write_atomically(root / LATEST, staging.name.encode())
        return staging

    def discard(self, staging: ObjectPath) -> None:
        """The staging place is the step's own prefix: never a committed checkpoint (a save
        that failed before its marker was removed, or once its marker was written)."""
        with contextlib.suppress(OSError):  # an unreachable store: the save's error says more
            if not self.is_complete(staging):
                staging.remove_tree()

    def remove(self, path: ObjectPath) -> None:
        """Best effort, as on a disk; never leaves a checkpoint half-removed and visible."""
        with contextlib.suppress(OSError):
            (path / CHECKSUMS).unlink(missing_ok=True)  # invisible before anything else goes
            path.remove_tree()

    def is_complete(self, path: ObjectPath) -> bool:
        return (path / CHECKSUMS).is_file()

    def list_steps(self, root: ObjectPath) -> list[int]:
        """The committed checkpoints only: one without its marker is a save in progress or
        one that crashed, never a checkpoint."""
        steps = [s for p in root.iterdir() if (s := step_of(p.name)) is not None]
        return sorted(s for s in steps if self.is_complete(root / f"step_{s}"))

    def latest_target(self, root: ObjectPath) -> str | None:
        latest = root / LATEST
        try:  # bytes that are not text name no folder: latest_problem says so
            return latest.read_bytes().decode("utf-8", "replace").strip()
        except FileNotFoundError:
            return None

    def remove_stale(self, root: ObjectPath) -> list[str]:
        stale = [
            p
            for p in root.iterdir()
            if step_of(p.name) is not None and not self.is_complete(p) and p.is_dir()
        ]
        for p in stale:
            p.remove_tree()
        return [p.name for p in stale]

    def writer(self, staging: ObjectPath, pool: ThreadPoolExecutor | None) -> FileSystemWriter:
        # an object is durable once its upload completes: no fsync (DCP would sync the disk)
        return FsspecWriter(str(staging), sync_files=False, **staging.fs_options)

    def reader(self, path: ObjectPath) -> FileSystemReader:
        return FsspecReader(str(path), **path.fs_options)


def storage_of(path: CheckpointPath) -> Storage:
    """The storage a checkpoint path lives on."""
    return ObjectStorage() if isinstance(path, ObjectPath) else PosixStorage()
