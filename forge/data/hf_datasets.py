"""Hugging Face datasets as input (``--hf-dataset NAME``), through the optional ``datasets``
package (the ``data`` extra).

- A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` is opened with
  ``load_from_disk`` and read as the Arrow files it is made of (``Dataset.cache_files``) by
  the Arrow reader: units are record-batch ranges, like any Arrow input.
- Anything else (a Hub name, a local folder of data files) goes to
  ``load_dataset(NAME, config, split=split, streaming=True)``: the corpus is streamed, never
  materialised. A unit is one shard of the streamed dataset (``IterableDataset.shard``; the
  shards are its data files), so a resumed run skips the finished shards.
"""

from __future__ import annotations

import functools
import pathlib
from collections import Counter
from types import ModuleType
from typing import Any

import attrs

from forge.data.recipe import Documents, InputFormat, Reader, Recipe, Skip, Unit
from forge.data.shards import DataError
from forge.data.tables import BATCH_ROWS, EXTRA, check_column, column_documents, import_pyarrow
from forge.errors import one_line

DEFAULT_SPLIT = "train"
SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes first


@attrs.frozen
class HFSource:
    """Where a ``--hf-dataset`` is read from, as the recipe records it."""

    root: str  # the folder (resolved), or the Hub name
    input_format: InputFormat  # ARROW for a saved folder, HF for a streamed dataset
    inputs: tuple[tuple[str, int], ...]  # local files and sizes; none for a Hub dataset
    split: str


def import_datasets(name: str) -> ModuleType:
    """The ``datasets`` package, quiet (no progress bars or warnings on stderr: errors are
    reported in one line); a ``DataError`` naming the extra when it is not installed."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"--hf-dataset {name}: reading Hugging Face datasets {EXTRA}") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def hf_source(name: str, config: str | None, split: str | None) -> HFSource:
    """Resolve ``--hf-dataset NAME``: a saved folder's Arrow files, or a dataset to stream
    (opened once here, so that an unknown name, config or split is refused before any work)."""
    folder = pathlib.Path(name)
    if folder.is_dir() and any((folder / m).is_file() for m in SAVED_MARKERS):
        return saved_source(folder.resolve(), config, split)
    import_pyarrow(f"--hf-dataset {name}")
    root = str(folder.resolve()) if folder.exists() else name
    split = split or DEFAULT_SPLIT
    streamed(root, config, split)
    inputs: tuple[tuple[str, int], ...] = ()
    if folder.is_dir():  # a local dataset: its files and sizes are in the recipe
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        inputs = tuple((p.relative_to(folder).as_posix(), p.stat().st_size) for p in files)
    return HFSource(root, InputFormat.HF, inputs, split)


def saved_source(folder: pathlib.Path, config: str | None, split: str | None) -> HFSource:
    """The Arrow files of the chosen split of a ``save_to_disk`` folder."""
    where = f"--hf-dataset {folder}"
    datasets = import_datasets(str(folder))
    if config is not None:
        raise DataError(
            f"--hf-config {config}: {folder} is a saved dataset (save_to_disk), which has no "
            "configurations; drop --hf-config"
        )
    try:
        loaded = datasets.load_from_disk(str(folder), keep_in_memory=False)  # file-backed
    except Exception as exc:  # datasets raises bare FileNotFoundError / ValueError / KeyError
        raise DataError(f"{where}: cannot be loaded ({one_line(exc)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        chosen = split or DEFAULT_SPLIT
        if chosen not in loaded:
            raise DataError(
                f"--hf-split {chosen}: not a split of {folder} (splits: {', '.join(loaded)}); "
                "choose one with --hf-split"
            )
        loaded = loaded[chosen]
    else:
        chosen = str(loaded.split) if loaded.split is not None else DEFAULT_SPLIT
        if split is not None and split != chosen:
            raise DataError(
                f"--hf-split {split}: {folder} is one saved split, '{chosen}'; drop --hf-split"
            )
    files = [pathlib.Path(f["filename"]).resolve() for f in loaded.cache_files]
    inputs = tuple((p.relative_to(folder).as_posix(), p.stat().st_size) for p in files)
    return HFSource(str(folder), InputFormat.ARROW, inputs, chosen)


@functools.cache  # once per process: resolving a dataset's files can take seconds
def streamed(name: str, config: str | None, split: str) -> Any:
    """``load_dataset(name, config, split=split, streaming=True)``; failures as one line."""
    datasets = import_datasets(name)
    try:
        return datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as exc:  # datasets raises many kinds; each becomes one line below
        raise load_failure(name, config, split, exc) from None


def load_failure(name: str, config: str | None, split: str, exc: Exception) -> DataError:
    """The one line for a dataset that cannot be opened, naming the option to fix."""
    cause = one_line(exc)
    if isinstance(exc, ConnectionError):  # offline mode, or no network
        return DataError(
            f"--hf-dataset {name}: not a local folder, and the Hugging Face Hub cannot be "
            f"reached ({cause}); check the name, or go online (HF_HUB_OFFLINE / "
            "HF_DATASETS_OFFLINE unset)"
        )
    if type(exc).__name__ == "DatasetNotFoundError":
        return DataError(
            f"--hf-dataset {name}: no such dataset, locally or on the Hub ({cause}); check "
            "the name (a gated dataset needs `hf auth login`)"
        )
    if "split" in str(exc).lower():
        return DataError(f"--hf-split {split}: not a split of {name} ({cause})")
    if "config" in str(exc).lower():
        return DataError(f"--hf-config {config}: not a configuration of {name} ({cause})")
    return DataError(f"--hf-dataset {name}: cannot be loaded ({cause})")


def hf_units(root: pathlib.Path, recipe: Recipe, unit_bytes: int) -> list[Unit]:
    """One unit per shard of the streamed dataset (a fixed number: its data files)."""
    dataset = streamed(recipe.root, recipe.hf_config, str(recipe.hf_split))
    features = dataset.features  # None when the dataset does not declare them
    if features is not None:
        check_features(recipe, features)
    return [Unit(i, (str(recipe.hf_split),), i, i + 1) for i in range(dataset.num_shards)]


def check_features(recipe: Recipe, features: Any) -> None:
    """Refuse declared features without a string column ``--field``."""
    check_column(f"--hf-dataset {recipe.root}", features.arrow_schema, recipe.field)


def hf_documents(
    root: pathlib.Path, unit: Unit, recipe: Recipe, skipped: Counter[Skip]
) -> Documents:
    """The rows of one shard, as Arrow tables of ``BATCH_ROWS`` rows, named
    ``split/shard@row``."""
    dataset = streamed(recipe.root, recipe.hf_config, str(recipe.hf_split))
    shard = dataset.shard(num_shards=dataset.num_shards, index=unit.start)
    batches = shard.select_columns([recipe.field]).with_format("arrow").iter(BATCH_ROWS)
    name = f"{recipe.hf_split}/{unit.start}"
    try:
        yield from column_documents(name, 0, batches, recipe.field, skipped)
    except DataError:
        raise
    except Exception as exc:  # a damaged file, a lost connection: one line naming the shard
        raise DataError(
            f"--hf-dataset {recipe.root}: shard {unit.start} cannot be read ({one_line(exc)})"
        ) from None


HF = Reader(hf_units, hf_documents)
