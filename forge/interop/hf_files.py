"""A Hugging Face folder's files, read for ``hf_import``: ``config.json`` and the index as
checked JSON, the weights' files (``model.safetensors``, or the shards an index lists) found
and their headers and tensors read. A file that is absent, not a regular file, too large,
damaged or not what it says is one ``ExportError`` line naming it, never a traceback."""

from __future__ import annotations

import pathlib

import attrs
import torch

from forge.errors import one_line
from forge.interop.hf_config import (
    CONFIG_JSON,
    IGNORED_TENSOR,
    JSON_LIMIT,
    WEIGHTS,
    WEIGHTS_INDEX,
)
from forge.interop.hf_json import counted, decode_json, json_kind, listed, shown
from forge.interop.tensor_names import ExportError


@attrs.frozen
class Weights:
    """Where a folder's weights are: ``label`` (``model.safetensors``, or the index of a
    sharded checkpoint) and each file with the tensors to read from it (None: all)."""

    label: pathlib.Path
    files: dict[pathlib.Path, tuple[str, ...] | None]


def folder_problem(folder: pathlib.Path) -> str | None:
    """Why ``folder`` is not a folder to import from, if it is not."""
    if not folder.exists():
        return (
            f"{folder}: no such folder; pass a Hugging Face model folder ({CONFIG_JSON} and "
            f"{WEIGHTS})"
        )
    if not folder.is_dir():
        return f"{folder}: is a file; pass the folder that holds {CONFIG_JSON} and {WEIGHTS}"
    return None


def file_problem(path: pathlib.Path, missing: str) -> str | None:
    """Why ``path`` is not a regular file to read (``missing`` says what to do when it is
    absent), if it is not: a directory, a pipe or a device is never read (it could block)."""
    if path.is_dir():
        return f"{path}: is a directory, not a file"
    if not path.exists():
        return f"{path}: missing; {missing}"
    if not path.is_file():
        return f"{path}: is not a regular file (a pipe, a socket or a device); put the file there"
    return None


def read_json(path: pathlib.Path, missing: str) -> object:
    """The JSON document in ``path``; ``ExportError`` naming it when it is absent (``missing``
    says what to do), not a regular file, too large, unreadable, not UTF-8 or not JSON."""
    problem = file_problem(path, missing)
    if problem is not None:
        raise ExportError(problem)
    try:
        size = path.stat().st_size
        data = path.read_bytes() if size <= JSON_LIMIT else b""
    except OSError as exc:
        raise ExportError(f"{path}: cannot be read ({one_line(exc)})") from exc
    if size > JSON_LIMIT:
        raise ExportError(f"{path}: {size} bytes, beyond the 64 MiB a JSON file of a model holds")
    doc, problem = decode_json(data)
    if problem is not None:
        raise ExportError(f"{path}: {problem}")
    return doc


def plain_file_name(value: object) -> bool:
    """Whether ``value`` names a file in the folder itself (no path, no parent)."""
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in "/\\\0")
    )


def index_problems(doc: object) -> list[str]:
    """Why ``doc`` (a parsed ``model.safetensors.index.json``) does not map tensor names to
    shard files in its folder, if it does not."""
    if not isinstance(doc, dict):
        return [f"expected a JSON object ({{...}}), got {json_kind(doc)}"]
    if "weight_map" not in doc:
        return ["weight_map: missing; a sharded checkpoint's index maps each tensor to its file"]
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        return [
            f"weight_map: expected an object of tensor name: file name, got {json_kind(weight_map)}"
        ]
    bad = [
        f"weight_map[{shown(name)}]: {shown(file)} is not a file name in the folder"
        for name, file in weight_map.items()
        if not plain_file_name(file)
    ]
    return [listed(bad, 1)] if bad else []


def missing_weights_line(folder: pathlib.Path) -> str:
    """The refusal of a folder with neither ``model.safetensors`` nor an index."""
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    hint = (
        f" ({listed(pickled, 1)} is a pickle, which could run code: convert it to safetensors "
        "first)"
        if pickled
        else ""
    )
    return (
        f"{folder / WEIGHTS}: missing, and no sharded {WEIGHTS_INDEX} either; forge imports "
        f"safetensors weights{hint}"
    )


def find_weights(folder: pathlib.Path) -> Weights:
    """``model.safetensors``, or the shards ``model.safetensors.index.json`` lists (each
    checked to be there; a folder holding both is refused); ``ExportError`` naming the file
    otherwise."""
    single, index = folder / WEIGHTS, folder / WEIGHTS_INDEX
    if (single.exists() or single.is_symlink()) and (index.exists() or index.is_symlink()):
        raise ExportError(
            f"{folder}: holds both {WEIGHTS} and {WEIGHTS_INDEX} (a sharded checkpoint); which "
            "is the model is not said: keep the one you mean to import, move the other away"
        )
    if single.exists() or single.is_symlink():
        problem = file_problem(single, "it is a link to nothing")
        if problem is not None:
            raise ExportError(problem)
        return Weights(single, {single: None})
    if not index.exists():
        raise ExportError(missing_weights_line(folder))
    doc = read_json(index, "it is a link to nothing")
    problems = index_problems(doc)
    if problems or not isinstance(doc, dict):
        raise ExportError([f"{index}: {p}" for p in problems])
    shards: dict[str, list[str]] = {}
    for name, file in doc["weight_map"].items():
        shards.setdefault(file, []).append(name)
    absent = [folder / file for file in shards if not (folder / file).is_file()]
    if absent:
        raise ExportError(
            f"{listed([str(p) for p in absent], 2)}: missing; {WEIGHTS_INDEX} lists "
            f"{counted(len(shards), 'shard')}: download the missing ones again"
        )
    return Weights(index, {folder / file: tuple(names) for file, names in shards.items()})


def damaged_line(path: pathlib.Path, exc: Exception) -> str:
    """A safetensors file that does not open or read: one line with its cause."""
    cause = " ".join(str(exc).split())[:200]
    return (
        f"{path}: not a safetensors file, or a damaged one ({cause}); download or export it again"
    )


def read_headers(weights: Weights) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's shape and safetensors dtype (``F32``, ``BF16``, ``F8_E4M3`` ...), from the
    files' headers (no tensor read yet)."""
    from safetensors import SafetensorError, safe_open

    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for path, names in weights.files.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = f.keys()  # a safe_open handle is not iterable
                held = {
                    k: (tuple(f.get_slice(k).get_shape()), str(f.get_slice(k).get_dtype()))
                    for k in keys
                }
        except SafetensorError as exc:
            raise ExportError(damaged_line(path, exc)) from exc
        except OSError as exc:
            raise ExportError(f"{path}: cannot be read ({one_line(exc)})") from exc
        lacking = [n for n in names or () if n not in held]
        if lacking:
            raise ExportError(
                f"{weights.label}: lists {counted(len(lacking), 'tensor')} in {path.name} that "
                f"it does not hold ({listed(lacking)}); the index and its shards disagree"
            )
        headers |= {n: held[n] for n in (names if names is not None else held)}
    return headers


def read_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """The tensors of ``weights`` (those the index lists, for a sharded checkpoint)."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path, names in weights.files.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names if names is not None else f.keys():
                    if not IGNORED_TENSOR.search(name):
                        tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, TypeError, ValueError) as exc:
            raise ExportError(damaged_line(path, exc)) from exc
    return tensors
