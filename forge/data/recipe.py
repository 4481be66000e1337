"""What a prepared dataset is made from (the *recipe*), the units its preparation is cut into,
and the shape of a *reader*: how one input format is cut into units and read back.

``forge.data.prepare`` is generic over readers; the readers live in ``forge.data.text_inputs``
(folders of files, JSONL), ``forge.data.tables`` (Parquet, Arrow IPC) and
``forge.data.hf_datasets`` (Hugging Face ``datasets``, streamed).
"""

from __future__ import annotations

import enum
import pathlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import attrs


class InputFormat(enum.Enum):
    FILES = "files"  # every file is one document
    JSONL = "jsonl"  # every line is a JSON object; one field holds the document's text
    PARQUET = "parquet"  # every row is a document; one string column holds its text
    ARROW = "arrow"  # the same, in Arrow IPC files (file or stream format: datasets' cache)
    HF = "hf"  # a Hugging Face dataset through ``datasets.load_dataset(streaming=True)``


class TextErrors(enum.Enum):
    """What a JSONL line that is not UTF-8 does."""

    STRICT = "strict"  # refuse the input, naming file and line
    REPLACE = "replace"  # decode with U+FFFD for each bad byte


class Skip(enum.Enum):
    """Input that is passed over, counted, and reported in the summary."""

    BINARY = "binary"  # a file with a NUL byte near its start, in a folder of text files
    NULL = "null"  # a null in the text column of a table (Parquet, Arrow, datasets)


@attrs.frozen
class Unit:
    """One piece of work: whole files, or the pieces ``[start, end)`` of one input, counted in
    the format's own pieces: bytes (JSONL), row groups (Parquet), record batches (Arrow), or
    the one shard ``start`` of a streamed dataset."""

    index: int
    files: tuple[str, ...]
    start: int = 0
    end: int = -1  # -1: whole files


@attrs.frozen
class Recipe:
    """Everything the dataset is a function of; two runs with equal recipes make equal data."""

    root: str  # the inputs' folder; for a Hub dataset, its name
    inputs: tuple[tuple[str, int], ...]  # (path relative to root, size in bytes)
    input_format: InputFormat
    field: str
    tokenizer: dict[str, Any]
    validation_percent: float
    shard_tokens: int
    errors: TextErrors = TextErrors.STRICT  # JSONL lines that are not UTF-8
    hf_config: str | None = None  # --hf-config (a Hugging Face dataset's configuration)
    hf_split: str | None = None  # --hf-split; set exactly when the input came from --hf-dataset

    def to_json(self) -> dict[str, Any]:
        """The recipe as JSON values; options left at their defaults are left out, so that
        recipes written before an option existed stay equal."""
        raw = attrs.asdict(self)
        raw["input_format"] = self.input_format.value
        raw["inputs"] = [list(x) for x in self.inputs]
        if self.errors is TextErrors.STRICT:
            del raw["errors"]
        else:
            raw["errors"] = self.errors.value
        for key in ("hf_config", "hf_split"):
            if raw[key] is None:
                del raw[key]
        return raw

    @property
    def flag(self) -> str:
        """The option that named the input, for error lines."""
        return "--hf-dataset" if self.hf_split is not None else "--input"


Documents = Iterator[tuple[str, bytes]]  # (a name stable across runs, the text as UTF-8)


@attrs.frozen
class Reader:
    """One input format: ``units(root, recipe, unit_bytes)`` cuts the inputs into units of
    about ``unit_bytes`` (reading metadata only, and refusing bad input with ``DataError``);
    ``documents(root, unit, recipe, skipped)`` yields a unit's documents in a fixed order,
    counting what it passes over in ``skipped``."""

    units: Callable[[pathlib.Path, Recipe, int], list[Unit]]
    documents: Callable[[pathlib.Path, Unit, Recipe, Counter[Skip]], Documents]
