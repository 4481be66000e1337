"""Tokenize a corpus into shards plus a manifest, in parallel worker processes, resumably.

The input is cut into *units* by the reader of its format (``forge.data.recipe.Reader``: a
group of files, a line-aligned byte range of a JSONL file, a range of Parquet row groups or
Arrow record batches, a shard of a streamed Hugging Face dataset). Workers tokenize units into
``<out>.tmp/parts/``; a unit's small JSON record is written last, by rename, so a unit is
either done or redone. An interrupted run started again with the same recipe skips the
finished units. When all are done, the parts are joined in unit order (so the dataset does
not depend on the number of workers) into shards, the manifest is written and ``<out>.tmp``
is renamed to ``<out>``.

The *recipe* (inputs with their sizes, format, field, tokenizer, split share, shard size) is
stored in the manifest: preparing into a folder that holds another recipe's dataset is refused.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import attrs
import numpy as np

from forge.data import hf_datasets, tables, text_inputs
from forge.data.corpus import split_of
from forge.data.recipe import InputFormat, Reader, Recipe, Skip, Unit
from forge.data.shards import (
    MANIFEST,
    DataError,
    Manifest,
    ShardWriter,
    publish,
    token_dtype,
)
from forge.data.tokenizer import Tokenizer, tokenizer_from_manifest
from forge.errors import one_line
from forge.outputs import enclosing_dataset, enclosing_run

SPLITS = ("train", "validation")
UNIT_BYTES = 4 << 20  # input bytes per unit: big enough to amortize, small enough to balance
READERS: dict[InputFormat, Reader] = {
    InputFormat.FILES: text_inputs.FILES,
    InputFormat.JSONL: text_inputs.JSONL,
    InputFormat.PARQUET: tables.PARQUET,
    InputFormat.ARROW: tables.ARROW,
    InputFormat.HF: hf_datasets.HF,
}


def make_units(root: pathlib.Path, recipe: Recipe) -> list[Unit]:
    """Cut the inputs into units of about ``UNIT_BYTES``, in input order."""
    return READERS[recipe.input_format].units(root, recipe, UNIT_BYTES)


@functools.cache  # once per worker process, not once per unit
def cached_tokenizer(description: str) -> Tokenizer:
    """The tokenizer of a manifest description, given as JSON (hashable)."""
    return tokenizer_from_manifest(json.loads(description))


def tokenize_unit(args: tuple[pathlib.Path, pathlib.Path, Unit, Recipe]) -> dict[str, Any]:
    """Worker: tokenize one unit into ``parts/<index>.<split>.bin``; returns its record."""
    root, parts, unit, recipe = args
    tokenizer = cached_tokenizer(json.dumps(recipe.tokenizer, sort_keys=True))
    dtype = token_dtype(tokenizer.vocab_size)
    skipped: Counter[Skip] = Counter()
    counts = {split: {"tokens": 0, "documents": 0} for split in SPLITS}
    paths = {split: parts / f"{unit.index:06d}.{split}.bin" for split in SPLITS}
    with contextlib.ExitStack() as stack:
        # written as they come: a unit's tokens (a whole shard of a streamed dataset) need
        # not fit in memory
        files = {
            split: stack.enter_context(path.with_suffix(".bin.tmp").open("wb", 1 << 20))
            for split, path in paths.items()
        }
        for name, data in READERS[recipe.input_format].documents(root, unit, recipe, skipped):
            split = split_of(name, recipe.validation_percent)
            tokens = tokenizer.frame(data, dtype)
            files[split].write(tokens.tobytes())
            counts[split]["tokens"] += len(tokens)
            counts[split]["documents"] += 1
    for path in paths.values():
        os.replace(path.with_suffix(".bin.tmp"), path)
    record: dict[str, Any] = {
        "index": unit.index,
        "splits": counts,
        "skipped_binary": skipped[Skip.BINARY],
        "skipped_null": skipped[Skip.NULL],
    }
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
        """One more unit done, holding ``tokens``: redraw the line."""
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
        """End the line."""
        self.stream.write("\n")


@contextlib.contextmanager
def workers_ignoring_interrupts() -> Iterator[None]:
    """Processes started inside ignore SIGINT from their first instruction (an ignored signal
    stays ignored across exec, and Python keeps it so): Ctrl-C reaches the whole process group,
    and the main process answers it (one line, the finished units kept) and ends the pool,
    whose workers would otherwise each print a ``KeyboardInterrupt`` traceback, even one still
    importing. The main process's own handler is back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check_destination(out: pathlib.Path, recipe: Recipe) -> bool:
    """True when ``out`` already holds this recipe's dataset; refuses any other content, and a
    folder inside a dataset or a run directory (forge never adds to either)."""
    resolved = out.resolve()
    dataset = enclosing_dataset(resolved)
    if dataset is not None:
        raise DataError(
            f"--out {out}: lies inside the dataset {dataset}; choose a folder outside it"
        )
    run = enclosing_run(resolved)
    if run is not None:
        raise DataError(
            f"--out {out}: lies in the run or checkpoint directory {run}; choose a folder "
            "outside it"
        )
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
    from an interrupted run, binary files and null texts skipped."""

    manifest: Manifest | None
    reused_units: int = 0
    skipped_binary: int = 0
    skipped_null: int = 0


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
    return PrepareReport(manifest, len(done), skipped[Skip.BINARY], skipped[Skip.NULL])


def _run(
    todo: Sequence[Unit], root: pathlib.Path, parts: pathlib.Path, recipe: Recipe, workers: int
) -> Iterator[dict[str, Any]]:
    jobs = [(root, parts, unit, recipe) for unit in todo]
    if workers <= 1:
        yield from map(tokenize_unit, jobs)
        return
    # spawn: workers start clean (no inherited threads or tokenizer state)
    with workers_ignoring_interrupts():
        pool = multiprocessing.get_context("spawn").Pool(workers)
    with pool:
        yield from pool.imap_unordered(tokenize_unit, jobs)


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, with an s unless ``n`` is 1."""
    return f"{n} {noun}{'s' if n != 1 else ''}"


def skips(records: Sequence[dict[str, Any]]) -> Counter[Skip]:
    """What the units' records say was skipped, by kind."""
    return Counter({kind: sum(r.get(f"skipped_{kind.value}", 0) for r in records) for kind in Skip})


def check_has_text(records: Sequence[dict[str, Any]], recipe: Recipe) -> None:
    """Refuse (``DataError``) inputs that hold no text: every file binary, every JSONL line
    blank, every row null, or every document empty. Such a dataset would hold nothing to
    train on."""
    documents = sum(s["documents"] for r in records for s in r["splits"].values())
    tokens = sum(s["tokens"] for r in records for s in r["splits"].values())
    if tokens > 2 * documents:  # every document is framed by exactly a BOS and an EOS
        return
    skipped = skips(records)
    nouns = {Skip.BINARY: "binary file", Skip.NULL: "null text"}
    found = [f"{plural(n, nouns[kind])} skipped" for kind, n in skipped.items() if n]
    fmt = recipe.input_format
    if documents:
        found.append(plural(documents, "empty document"))
    elif not found:
        found.append("every line is blank" if fmt is InputFormat.JSONL else "no rows")
    root = pathlib.Path(recipe.root)
    name = root / recipe.inputs[0][0] if len(recipe.inputs) == 1 else recipe.root
    if recipe.hf_split is not None:
        name = recipe.root
    if fmt is InputFormat.FILES:
        fix = "point --input at text files, or choose them with --glob"
    elif fmt is InputFormat.JSONL:
        fix = f"point --input at JSONL lines whose --field '{recipe.field}' holds text"
    else:
        fix = f"choose a column that holds text with --field (now '{recipe.field}')"
    raise DataError(f"{recipe.flag} {name}: holds no text to tokenize ({', '.join(found)}); {fix}")


def assemble(
    tmp: pathlib.Path, parts: pathlib.Path, n_units: int, recipe: Recipe
) -> tuple[Manifest, Counter[Skip]]:
    """Join the units' parts, in unit order, into shards; the manifest of the result and
    what was skipped."""
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
    return Manifest(
        dtype=dtype.name,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.describe(),
        splits=splits,
        source=recipe.root,
    ), skips(records)
