"""Where a checkpoint lies: a local (or mounted) ``pathlib.Path`` or an ``ObjectPath`` in an
object store. The few operations whose rule differs between the two live here, below the
readers and the storage seam that both use them."""

from __future__ import annotations

import io
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

from forge.checkpoint.object_path import ObjectPath, object_path
from forge.config.ranges import url_scheme

CheckpointPath = pathlib.Path | ObjectPath
LOCAL_PROTOCOLS = frozenset({"file", "local"})


def write_atomically(path: CheckpointPath, data: bytes) -> None:
    """``path`` holds ``data`` whole or keeps what it held: a local file is written to a
    temporary name, synced and renamed; an object is whole once its upload completes."""
    if isinstance(path, ObjectPath):
        path.write_bytes(data)
        return
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_tensors(value: Any, path: CheckpointPath) -> None:
    """``torch.save`` to a file or an object."""
    if isinstance(path, ObjectPath):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        path.write_bytes(buffer.getvalue())
    else:
        torch.save(value, path)


def is_remote(path: CheckpointPath) -> bool:
    return isinstance(path, ObjectPath)


def file_sizes(folder: CheckpointPath) -> dict[str, int]:
    """The size of each file directly in ``folder`` (one listing; empty when it is absent)."""
    if isinstance(folder, ObjectPath):
        return folder.file_sizes()
    if not folder.is_dir():
        return {}
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}


def location(
    text: str, options: Mapping[str, Any] | None = None, timeout_s: float | None = None
) -> CheckpointPath:
    """The checkpoint location a config value names: a URL (``s3://bucket/prefix``, opened
    with fsspec's ``options``, each call waiting at most ``timeout_s`` for the store) or a
    local path."""
    scheme = url_scheme(text)
    if scheme in LOCAL_PROTOCOLS:  # a local folder: the disk's rules (rename, symlink)
        return pathlib.Path(text.split("://", 1)[1])
    if scheme is not None:
        return object_path(text, options, timeout_s)
    return pathlib.Path(text)
