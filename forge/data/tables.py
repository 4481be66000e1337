"""Readers of tables: Parquet files, cut into row-group ranges, and Arrow IPC files in the file
or the stream format (the stream format is what ``datasets`` caches and saves to disk), cut
into record-batch ranges. Every row is a document, its text in the string column ``--field``;
a null there is skipped and counted. Only that column is read, a batch at a time, so a table
larger than memory is fine. pyarrow comes with the optional ``data`` extra."""

from __future__ import annotations

import contextlib
import pathlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any

from forge.data.recipe import Documents, Reader, Recipe, Skip, Unit
from forge.data.shards import DataError
from forge.errors import one_line

EXTRA = "needs the 'data' extra: pip install -e '.[data]'"
BATCH_ROWS = 1024  # rows per batch read: a few MB of text at most, whatever the table's size
ARROW_FILE_MAGIC = b"ARROW1"  # the IPC file format starts (and ends) with it; a stream does not


def import_pyarrow(where: str) -> ModuleType:
    """``pyarrow`` with its IPC and Parquet modules loaded; a ``DataError`` naming the extra
    when it is not installed."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # loads pyarrow.parquet as an attribute of pyarrow
    except ImportError:
        raise DataError(f"{where}: reading Parquet and Arrow {EXTRA}") from None
    return pyarrow


MIN_UNITS = 32  # a small table is still cut into this many units, to keep every worker busy


def unit_target(recipe: Recipe, unit_bytes: int) -> int:
    """Bytes per unit: ``unit_bytes``, or less for a small input, so that it makes about
    ``MIN_UNITS`` units (none below a 16th of ``unit_bytes``). A function of the inputs' size
    alone, never of the worker count: the dataset does not depend on it."""
    total = sum(size for _, size in recipe.inputs)
    return min(unit_bytes, max(unit_bytes // 16, total // MIN_UNITS))


def piece_ranges(sizes: Sequence[int], target: int) -> Iterator[tuple[int, int]]:
    """Consecutive ranges ``[start, end)`` of pieces (row groups, record batches) of at least
    ``target`` bytes each, the last one excepted; all of them together cover every piece."""
    start, size = 0, 0
    for i, nbytes in enumerate(sizes):
        size += nbytes
        if size >= target:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(sizes):
        yield start, len(sizes)


def check_column(where: str, schema: Any, field: str) -> None:
    """Refuse a schema without a string column ``field``, naming the columns there are."""
    pa = import_pyarrow(where)
    if field not in schema.names:
        raise DataError(
            f"{where}: no column '{field}' (columns: {', '.join(schema.names) or 'none'}); "
            "choose the text column with --field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_string_view(kind)):
        raise DataError(
            f"{where}: column '{field}' holds {kind}, not strings; choose the text column "
            "with --field"
        )


def is_string_view(kind: Any) -> bool:
    """Whether ``kind`` is Arrow's ``string_view`` (a string column too; pyarrow >= 16)."""
    pa = import_pyarrow("--input")
    return bool(getattr(pa.types, "is_string_view", lambda _: False)(kind))


def column_documents(
    name: str, first_row: int, batches: Iterable[Any], field: str, skipped: Counter[Skip]
) -> Documents:
    """The documents of ``batches`` (record batches or tables), named ``name@row`` by their
    row in the input; nulls are skipped and counted."""
    row = first_row
    for batch in batches:
        check_column(name, batch.schema, field)  # a streamed dataset's schema is known late
        for text in batch.column(field).to_pylist():
            if text is None:
                skipped[Skip.NULL] += 1
            else:
                yield f"{name}@{row}", text.encode("utf-8")
            row += 1


@contextlib.contextmanager
def read_errors(where: str) -> Iterator[None]:
    """pyarrow's errors on damaged data, as one ``DataError`` line naming ``where``."""
    pa = import_pyarrow(where)
    try:
        yield
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{where}: cannot be read, damaged or truncated ({one_line(exc)})"
        ) from None


def open_parquet(path: pathlib.Path, field: str) -> Any:
    """The ``ParquetFile`` at ``path``, its schema checked for the text column."""
    pa = import_pyarrow(str(path))
    try:
        parquet = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{path}: not a Parquet file, or a damaged one ({one_line(exc)}); "
            "check the file, or choose the files with --glob"
        ) from None
    check_column(str(path), parquet.schema_arrow, field)
    return parquet


def ranged_units(
    root: pathlib.Path,
    recipe: Recipe,
    unit_bytes: int,
    piece_sizes: Callable[[pathlib.Path], list[int]],
) -> list[Unit]:
    """Each input cut into ranges of its pieces (row groups, record batches) of about
    ``unit_target`` bytes, ``piece_sizes`` giving a file's piece sizes in order."""
    units: list[Unit] = []
    target = unit_target(recipe, unit_bytes)
    for name, _ in recipe.inputs:
        for start, end in piece_ranges(piece_sizes(root / name), target):
            units.append(Unit(len(units), (name,), start, end))
    return units


def parquet_units(root: pathlib.Path, recipe: Recipe, unit_bytes: int) -> list[Unit]:
    """Ranges of row groups of about ``unit_target`` bytes (uncompressed), from the files'
    footers."""

    def sizes(path: pathlib.Path) -> list[int]:
        meta = open_parquet(path, recipe.field).metadata
        return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]

    return ranged_units(root, recipe, unit_bytes, sizes)


def parquet_documents(
    root: pathlib.Path, unit: Unit, recipe: Recipe, skipped: Counter[Skip]
) -> Documents:
    """The rows of the unit's row groups, reading only the text column."""
    name = unit.files[0]
    parquet = open_parquet(root / name, recipe.field)
    meta = parquet.metadata
    first_row = sum(meta.row_group(i).num_rows for i in range(unit.start))
    with read_errors(f"{root / name}: row groups {unit.start}-{unit.end - 1}"):
        batches = parquet.iter_batches(
            batch_size=BATCH_ROWS,
            row_groups=list(range(unit.start, unit.end)),
            columns=[recipe.field],
            use_threads=False,  # the workers are the parallelism
        )
        yield from column_documents(name, first_row, batches, recipe.field, skipped)


@contextlib.contextmanager
def open_arrow(path: pathlib.Path, field: str) -> Iterator[tuple[Any, Any]]:
    """``(reader, schema)`` of the Arrow IPC file at ``path``, memory-mapped, reading only
    the text column: a ``RecordBatchFileReader`` for the file format (random access to its
    batches), a ``RecordBatchStreamReader`` for the stream format (read from its start)."""
    pa = import_pyarrow(str(path))
    with path.open("rb") as f:
        is_file_format = f.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC
    kind = "file" if is_file_format else "stream"
    with pa.memory_map(str(path)) as source:
        try:
            schema = (pa.ipc.open_file if is_file_format else pa.ipc.open_stream)(source).schema
            check_column(str(path), schema, field)
            options = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index(field)])
            source.seek(0)
            opened = (pa.ipc.open_file if is_file_format else pa.ipc.open_stream)(
                source, options=options
            )
        except (pa.ArrowException, OSError) as exc:
            raise DataError(
                f"{path}: not an Arrow IPC file, or a damaged one (read as the {kind} format: "
                f"{one_line(exc)}); check the file, or choose the files with --glob"
            ) from None
        yield opened, schema


def arrow_batches(reader: Any) -> Iterator[Any]:
    """Every record batch of an open IPC file or stream, in order."""
    if hasattr(reader, "num_record_batches"):  # the file format
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        # a stream is read from its start; memory-mapped and uncompressed (datasets' cache),
        # a batch passed over costs its metadata only, not its text
        yield from reader


def arrow_units(root: pathlib.Path, recipe: Recipe, unit_bytes: int) -> list[Unit]:
    """Ranges of record batches of about ``unit_target`` bytes."""

    def sizes(path: pathlib.Path) -> list[int]:
        with open_arrow(path, recipe.field) as (reader, _), read_errors(str(path)):
            return [batch.nbytes for batch in arrow_batches(reader)]

    return ranged_units(root, recipe, unit_bytes, sizes)


def arrow_documents(
    root: pathlib.Path, unit: Unit, recipe: Recipe, skipped: Counter[Skip]
) -> Documents:
    """The rows of the unit's record batches."""
    name = unit.files[0]
    where = f"{root / name}: record batches {unit.start}-{unit.end - 1}"
    with open_arrow(root / name, recipe.field) as (reader, _), read_errors(where):
        first_row, chosen = 0, []
        for i, batch in enumerate(arrow_batches(reader)):
            if i >= unit.end:
                break
            if i < unit.start:
                first_row += batch.num_rows
            else:
                chosen.append(batch)  # at most a unit of batches: memory-mapped, not copied
        yield from column_documents(name, first_row, chosen, recipe.field, skipped)


PARQUET = Reader(parquet_units, parquet_documents)
ARROW = Reader(arrow_units, arrow_documents)
