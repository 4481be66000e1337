"""Readers of text inputs: a folder of files (each file one document) and JSONL (each line
one document, its text in one field)."""

from __future__ import annotations

import json
import pathlib
from collections import Counter
from collections.abc import Callable, Iterator

from forge.data.recipe import Documents, Reader, Recipe, Skip, Unit
from forge.data.shards import DataError

SNIFF_BYTES = 8192  # a NUL byte in a file's first 8 KiB marks it as binary


def find_inputs(
    path: pathlib.Path, pattern: str, skip: Callable[[pathlib.Path], bool]
) -> list[pathlib.Path]:
    """Files to read: ``path`` itself, or the files under it matching ``pattern``, sorted."""
    if path.is_file():
        return [path]
    if path.exists() and not path.is_dir():  # a FIFO, a socket, a device: no size, no seek
        raise DataError(
            f"--input {path}: is not a regular file or a folder (a pipe or a device); write "
            "the input to a file first"
        )
    if not path.is_dir():
        raise DataError(f"--input {path}: no such file or folder")
    files = sorted(
        (p for p in path.glob(pattern) if p.is_file() and not skip(p)),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise DataError(f"--input {path}: no file matches --glob '{pattern}'")
    return files


def file_units(root: pathlib.Path, recipe: Recipe, unit_bytes: int) -> list[Unit]:
    """Groups of whole files of about ``unit_bytes``, in input order."""
    units: list[Unit] = []
    group: list[str] = []
    size = 0
    for name, nbytes in recipe.inputs:
        group.append(name)
        size += nbytes
        if size >= unit_bytes:
            units.append(Unit(len(units), tuple(group)))
            group, size = [], 0
    if group:
        units.append(Unit(len(units), tuple(group)))
    return units


def jsonl_units(root: pathlib.Path, recipe: Recipe, unit_bytes: int) -> list[Unit]:
    """Line-aligned byte ranges of about ``unit_bytes`` of each file, in input order."""
    units: list[Unit] = []
    for name, nbytes in recipe.inputs:
        for start, end in line_ranges(root / name, nbytes, unit_bytes):
            units.append(Unit(len(units), (name,), start, end))
    return units


def line_ranges(path: pathlib.Path, size: int, target: int) -> Iterator[tuple[int, int]]:
    """Byte ranges of about ``target`` bytes covering the file, each ending after a newline."""
    start = 0
    with path.open("rb") as f:
        while start < size:
            f.seek(min(start + target, size))
            f.readline()  # run on to the end of the line
            end = min(f.tell(), size)
            yield start, end
            start = end


def is_binary(data: bytes) -> bool:
    """Text files hold no NUL bytes; images, archives and compiled files almost always do."""
    return b"\0" in data[:SNIFF_BYTES]


def line_number(path: pathlib.Path, offset: int) -> int:
    """The 1-based number of the line starting at byte ``offset`` (read only on an error)."""
    with path.open("rb") as f:
        return f.read(offset).count(b"\n") + 1


def file_documents(
    root: pathlib.Path, unit: Unit, recipe: Recipe, skipped: Counter[Skip]
) -> Documents:
    """Each file of the unit, named by its relative path; binary files are skipped."""
    for name in unit.files:
        data = (root / name).read_bytes()
        if is_binary(data):
            skipped[Skip.BINARY] += 1
            continue
        yield name, data


def jsonl_documents(
    root: pathlib.Path, unit: Unit, recipe: Recipe, skipped: Counter[Skip]
) -> Documents:
    """The ``--field`` of each non-blank line of the unit's byte range, named
    ``file@offset``; a bad line is a ``DataError`` naming file and line."""
    name = unit.files[0]
    with (root / name).open("rb") as f:
        f.seek(unit.start)
        offset = unit.start
        while offset < unit.end:
            line = f.readline()
            start = offset
            offset += len(line)
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8", errors=recipe.errors.value)
            except UnicodeDecodeError as exc:
                where = f"{root / name}:{line_number(root / name, start)}"
                raise DataError(
                    f"{where}: not UTF-8 (byte {exc.start} of the line); fix the file, or pass "
                    "--errors=replace to decode bad bytes as U+FFFD"
                ) from None
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                where = f"{root / name}:{line_number(root / name, start)}"
                raise DataError(f"{where}: not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(recipe.field), str):
                where = f"{root / name}:{line_number(root / name, start)}"
                raise DataError(
                    f"{where}: no string field '{recipe.field}'; choose the text field with --field"
                )
            yield f"{name}@{offset}", record[recipe.field].encode("utf-8")


FILES = Reader(file_units, file_documents)
JSONL = Reader(jsonl_units, jsonl_documents)
