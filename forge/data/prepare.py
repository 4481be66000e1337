"""Tokenize a corpus into shards plus a manifest, in parallel worker processes, resumably.

The input is cut into *units* (a group of files, or a byte range of a JSONL file ending at a
line end). Workers tokenize units into ``<out>.tmp/parts/``; a unit's small JSON record is
written last, by rename, so a unit is either done or redone. An interrupted run started again
with the same recipe skips the finished units. When all are done, the parts are joined in
unit order (so the dataset does not depend on the number of workers) into shards, the
manifest is written and ``<out>.tmp`` is renamed to ``<out>``.

The *recipe* (inputs with their sizes, format, field, tokenizer, split share, shard size) is
stored in the manifest: preparing into a folder that holds another recipe's dataset is refused.
"""

from __future__ import annotations

import enum
import json
import multiprocessing
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import attrs
import numpy as np

from forge.data.corpus import split_of
from forge.data.shards import (
    MANIFEST,
    DataError,
    Manifest,
    ShardWriter,
    publish,
    token_dtype,
)
from forge.data.tokenizer import tokenizer_from_manifest
from forge.errors import one_line

SPLITS = ("train", "validation")
UNIT_BYTES = 4 << 20  # input bytes per unit: big enough to amortize, small enough to balance


class InputFormat(enum.Enum):
    FILES = "files"  # every file is one document
    JSONL = "jsonl"  # every line is a JSON object; one field holds the document's text


class TextErrors(enum.Enum):
    """What a JSONL line that is not UTF-8 does."""

    STRICT = "strict"  # refuse the input, naming file and line
    REPLACE = "replace"  # decode with U+FFFD for each bad byte


@attrs.frozen
class Unit:
    """One piece of work: whole files, or the bytes ``[start, end)`` of one JSONL file."""

    index: int
    files: tuple[str, ...]
    start: int = 0
    end: int = -1  # -1: whole files


@attrs.frozen
class Recipe:
    """Everything the dataset is a function of; two runs with equal recipes make equal data."""

    root: str
    inputs: tuple[tuple[str, int], ...]  # (path relative to root, size in bytes)
    input_format: InputFormat
    field: str
    tokenizer: dict[str, Any]
    validation_percent: float
    shard_tokens: int
    errors: TextErrors = TextErrors.STRICT  # JSONL lines that are not UTF-8

    def to_json(self) -> dict[str, Any]:
        raw = attrs.asdict(self)
        raw["input_format"] = self.input_format.value
        raw["inputs"] = [list(x) for x in self.inputs]
        if self.errors is TextErrors.STRICT:
            del raw["errors"]  # recipes written before the option existed stay equal
        else:
            raw["errors"] = self.errors.value
        return raw


def find_inputs(
    path: pathlib.Path, pattern: str, skip: Callable[[pathlib.Path], bool]
) -> list[pathlib.Path]:
    """Files to read: ``path`` itself, or the files under it matching ``pattern``, sorted."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"--input {path}: no such file or folder")
    files = sorted(
        (p for p in path.glob(pattern) if p.is_file() and not skip(p)),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise DataError(f"--input {path}: no file matches --glob '{pattern}'")
    return files


def make_units(root: pathlib.Path, recipe: Recipe) -> list[Unit]:
    """Cut the inputs into units of about ``UNIT_BYTES``, in input order."""
    units: list[Unit] = []
    if recipe.input_format is InputFormat.FILES:
        group: list[str] = []
        size = 0
        for name, nbytes in recipe.inputs:
            group.append(name)
            size += nbytes
            if size >= UNIT_BYTES:
                units.append(Unit(len(units), tuple(group)))
                group, size = [], 0
        if group:
            units.append(Unit(len(units), tuple(group)))
        return units
    for name, nbytes in recipe.inputs:
        for start, end in line_ranges(root / name, nbytes, UNIT_BYTES):
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


SNIFF_BYTES = 8192  # a NUL byte in a file's first 8 KiB marks it as binary


def is_binary(data: bytes) -> bool:
    """Text files hold no NUL bytes; images, archives and compiled files almost always do."""
    return b"\0" in data[:SNIFF_BYTES]


def line_number(path: pathlib.Path, offset: int) -> int:
    """The 1-based number of the line starting at byte ``offset`` (read only on an error)."""
    with path.open("rb") as f:
        return f.read(offset).count(b"\n") + 1


def read_documents(
    root: pathlib.Path, unit: Unit, recipe: Recipe, skipped: list[str] | None = None
) -> Iterator[tuple[str, bytes]]:
    """``(name, raw bytes)`` of each document in the unit; a name is stable across runs.
    Binary files (a NUL byte near the start) are not documents: their names go to
    ``skipped``."""
    if recipe.input_format is InputFormat.FILES:
        for name in unit.files:
            data = (root / name).read_bytes()
            if is_binary(data):
                if skipped is not None:
                    skipped.append(name)
                continue
            yield name, data
        return
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


def tokenize_unit(args: tuple[pathlib.Path, pathlib.Path, Unit, Recipe]) -> dict[str, Any]:
    """Worker: tokenize one unit into ``parts/<index>.<split>.bin``; returns its record."""
    root, parts, unit, recipe = args
    tokenizer = tokenizer_from_manifest(recipe.tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    arrays: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    skipped: list[str] = []
    for name, data in read_documents(root, unit, recipe, skipped):
        split = split_of(name, recipe.validation_percent)
        arrays[split].append(tokenizer.frame(data, dtype))
    record: dict[str, Any] = {"index": unit.index, "splits": {}, "skipped_binary": len(skipped)}
    for split, docs in arrays.items():
        tokens = np.concatenate(docs) if docs else np.empty(0, dtype)
        tmp = parts / f"{unit.index:06d}.{split}.bin.tmp"
        tokens.tofile(tmp)
        os.replace(tmp, parts / f"{unit.index:06d}.{split}.bin")
        record["splits"][split] = {"tokens": len(tokens), "documents": len(docs)}
    done = parts / f"{unit.index:06d}.json"
    done.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(done.with_suffix(".tmp"), done)  # last: the unit is done
    return record


class Progress:
    """One self-overwriting status line: units done, tokens, throughput."""

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total, self.stream = total, stream
        self.done = 0
        self.tokens = 0
        self.start = time.perf_counter()

    def advance(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        bar = "#" * (20 * self.done // max(self.total, 1))
        self.stream.write(
            f"\r[prepare] [{bar:<20}] {self.done}/{self.total} units, {self.tokens:,} tokens, "
            f"{rate / 1e6:.2f}M tokens/s"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


def check_destination(out: pathlib.Path, recipe: Recipe) -> bool:
    """True when ``out`` already holds this recipe's dataset; refuses any other content."""
    if not out.exists():
        return False
    manifest = out / MANIFEST
    if not manifest.is_file():
        raise DataError(f"--out {out}: exists and is not a prepared dataset; choose another --out")
    try:
        existing = json.loads(manifest.read_text()).get("recipe")
    except (json.JSONDecodeError, AttributeError):
        existing = None
    if existing != recipe.to_json():
        raise DataError(
            f"--out {out}: holds a different dataset (another input, tokenizer or setting); "
            "choose another --out or delete it"
        )
    return True


def prepare(
    out: pathlib.Path,
    root: pathlib.Path,
    recipe: Recipe,
    workers: int,
    progress: TextIO | None = sys.stderr,
) -> PrepareReport:
    """Build the dataset. Bad input or a failed write removes the temporary folder and raises
    ``DataError`` (one line); only an interruption (Ctrl-C, a kill) leaves it, to resume from."""
    if check_destination(out, recipe):
        return PrepareReport(None)
    tmp = out.with_name(out.name + ".tmp")
    try:
        return _prepare(out, tmp, root, recipe, workers, progress)
    except KeyboardInterrupt:
        raise
    except DataError:
        shutil.rmtree(tmp, ignore_errors=True)  # bad input: fixing it changes the recipe anyway
        raise
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"--out {out}: preparing the dataset failed ({one_line(exc)})") from None


@attrs.frozen
class PrepareReport:
    """What ``prepare`` did: the manifest (None: the dataset was already there), units reused
    from an interrupted run, binary files skipped."""

    manifest: Manifest | None
    reused_units: int = 0
    skipped_binary: int = 0


def _prepare(
    out: pathlib.Path,
    tmp: pathlib.Path,
    root: pathlib.Path,
    recipe: Recipe,
    workers: int,
    progress: TextIO | None,
) -> PrepareReport:
    parts = tmp / "parts"
    recipe_file = tmp / "recipe.json"
    if tmp.exists() and (
        not recipe_file.is_file() or json.loads(recipe_file.read_text()) != recipe.to_json()
    ):
        shutil.rmtree(tmp)  # an interrupted run of another recipe: nothing to reuse
    parts.mkdir(parents=True, exist_ok=True)
    recipe_file.write_text(json.dumps(recipe.to_json()))
    units = make_units(root, recipe)
    done = {int(p.stem) for p in parts.glob("*.json")}
    todo = [u for u in units if u.index not in done]
    bar = Progress(len(units), progress) if progress is not None else None
    try:
        for record in _run(todo, root, parts, recipe, workers):
            if bar is not None:
                bar.advance(sum(s["tokens"] for s in record["splits"].values()))
    finally:
        if bar is not None:
            bar.close()
    manifest, skipped = assemble(tmp, parts, len(units), recipe)
    shutil.rmtree(parts)
    (tmp / "recipe.json").unlink()
    publish(tmp, out, manifest, extra={"recipe": recipe.to_json()})
    return PrepareReport(manifest, len(done), skipped)


def _run(
    todo: Sequence[Unit], root: pathlib.Path, parts: pathlib.Path, recipe: Recipe, workers: int
) -> Iterator[dict[str, Any]]:
    jobs = [(root, parts, unit, recipe) for unit in todo]
    if workers <= 1:
        yield from map(tokenize_unit, jobs)
        return
    # spawn: workers start clean (no inherited threads or tokenizer state)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap_unordered(tokenize_unit, jobs)


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, with an s unless ``n`` is 1."""
    return f"{n} {noun}{'s' if n != 1 else ''}"


def check_has_text(records: Sequence[dict[str, Any]], recipe: Recipe) -> None:
    """Refuse (``DataError``) inputs that hold no text: every file binary, every JSONL line
    blank, or every document empty. Such a dataset would hold nothing to train on."""
    documents = sum(s["documents"] for r in records for s in r["splits"].values())
    tokens = sum(s["tokens"] for r in records for s in r["splits"].values())
    if tokens > 2 * documents:  # every document is framed by exactly a BOS and an EOS
        return
    skipped = sum(r.get("skipped_binary", 0) for r in records)
    found = [f"{plural(skipped, 'binary file')} skipped"] if skipped else []
    if documents:
        found.append(plural(documents, "empty document"))
    elif not skipped:
        found.append("every line is blank")
    root = pathlib.Path(recipe.root)
    name = root / recipe.inputs[0][0] if len(recipe.inputs) == 1 else root
    if recipe.input_format is InputFormat.FILES:
        fix = "point --input at text files, or choose them with --glob"
    else:
        fix = f"point --input at JSONL lines whose --field '{recipe.field}' holds text"
    raise DataError(f"--input {name}: holds no text to tokenize ({', '.join(found)}); {fix}")


def assemble(
    tmp: pathlib.Path, parts: pathlib.Path, n_units: int, recipe: Recipe
) -> tuple[Manifest, int]:
    """Join the units' parts, in unit order, into shards; the manifest of the result and the
    number of binary files skipped."""
    tokenizer = tokenizer_from_manifest(recipe.tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    records = [json.loads((parts / f"{i:06d}.json").read_text()) for i in range(n_units)]
    check_has_text(records, recipe)
    splits = {}
    for split in SPLITS:
        writer = ShardWriter(tmp, split, dtype, recipe.shard_tokens)
        for index, record in enumerate(records):
            tokens = np.fromfile(parts / f"{index:06d}.{split}.bin", dtype=dtype)
            if len(tokens):
                writer.append(tokens, documents=record["splits"][split]["documents"])
        splits[split] = writer.close()
    skipped = sum(r.get("skipped_binary", 0) for r in records)
    return Manifest(
        dtype=dtype.name,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.describe(),
        splits=splits,
        source=recipe.root,
    ), skipped
