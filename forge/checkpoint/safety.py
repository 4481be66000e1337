"""Loading a checkpoint never executes code from it.

DCP's ``.metadata`` is a pickle, and ``torch.distributed.checkpoint`` reads it with plain
``pickle.load``. Before DCP touches a checkpoint, forge reads that file with an unpickler that
only admits DCP's own metadata classes and torch dtypes, and checks that every data file it
names stays inside the checkpoint directory. The train state is JSON; RNG files load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import pathlib
import pickle
import pickletools
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from forge.checkpoint.object_path import ObjectPath
from forge.checkpoint.paths import CheckpointPath
from forge.errors import UserInputError

_ALLOWED = {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(UserInputError):
    """A checkpoint file that could run code, or that points outside its directory."""


class UnreadableCheckpointError(UserInputError):
    """A checkpoint file that is damaged (truncated, random bytes): an older one may load."""


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _ForbiddenGlobal(pickle.UnpicklingError):
    """The pickle names a class or function outside the allowed set."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise _ForbiddenGlobal(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata_safely(checkpoint: CheckpointPath) -> Metadata:
    """DCP's metadata of ``checkpoint``, refusing anything but metadata classes and any data
    file outside the directory."""
    path = checkpoint / ".metadata"
    try:
        with path.open("rb") as f:
            meta = _MetadataUnpickler(f).load()
    except _ForbiddenGlobal as exc:
        raise UnsafeCheckpointError(
            f"{path}: references {exc}, which a checkpoint never needs; refusing to load it "
            "(it could run code)"
        ) from None
    except Exception as exc:  # truncated or random bytes: unreadable, not unsafe
        raise UnreadableCheckpointError(
            f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(meta, Metadata):
        raise UnreadableCheckpointError(f"{path}: not DCP metadata")
    for info in (meta.storage_data or {}).values():
        relative = pathlib.PurePosixPath(str(getattr(info, "relative_path", "")))
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise UnsafeCheckpointError(
                f"{path}: names data file '{relative}' outside the checkpoint directory; "
                "refusing to load it"
            )
    return meta


_CODE_OPCODES = {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX"}


def _calls_code(path: CheckpointPath) -> bool:
    """Whether the file, read as a pickle, imports or calls anything (never executes it)."""
    try:
        with path.open("rb") as f:
            return any(op.name in _CODE_OPCODES for op, _, _ in pickletools.genops(f))
    except Exception:  # not a pickle past some point: judge by what came before
        return False


def load_tensors_safely(path: CheckpointPath) -> Any:
    """``torch.load`` that admits tensors and plain values only (no pickled code)."""
    try:
        source = path.stream() if isinstance(path, ObjectPath) else path
        return torch.load(source, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch names a forbidden class or function as "GLOBAL module.name"; a bare pickle
        # may stop torch's reader earlier, so it is scanned for code-calling opcodes. Anything
        # else (random bytes, an unknown opcode) is damage, not a payload.
        forbidden = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
        if forbidden or _calls_code(path):
            detail = forbidden[0] if forbidden else "it imports and calls code"
            raise UnsafeCheckpointError(
                f"{path}: holds more than tensors and plain values; refusing to load it ({detail})"
            ) from None
        raise UnreadableCheckpointError(f"{path}: unreadable (not a tensor file)") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        detail = " ".join(str(exc).split())[:200]
        raise UnreadableCheckpointError(f"{path}: unreadable ({detail})") from None
