"""Output folders that scripts write (an export, an imported checkpoint, an image–caption
dataset): never one that holds what forge did not write there, never inside a run directory
or a dataset, and written under a temporary sibling renamed into place, so that a failure
leaves nothing behind. A folder a script wrote is marked (``.forge-output``, naming its kind):
only that script's own earlier output may be replaced, and only when asked (``--overwrite``)."""

from __future__ import annotations

import contextlib
import enum
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator

MARKER = ".forge-output"


class OutputKind(enum.Enum):
    """What a script writes into an output folder."""

    HF_EXPORT = "hf_export"  # convert_checkpoint.py export, checkpoint.export_final
    IMPORTED_CHECKPOINT = "imported_checkpoint"  # convert_checkpoint.py import
    IMAGE_TEXT_DATASET = "image_text_dataset"  # prepare_vlm_data.py

    @property
    def noun(self) -> str:
        return {"hf_export": "export", "imported_checkpoint": "checkpoint"}.get(
            self.value, "dataset"
        )


def marked_kind(folder: pathlib.Path) -> OutputKind | None:
    """The kind ``folder``'s marker names; None when it has none (or an unknown one)."""
    try:
        return OutputKind((folder / MARKER).read_text().strip())
    except (OSError, ValueError):
        return None


MANIFEST = "manifest.json"


def unmarked_kind(folder: pathlib.Path) -> OutputKind | None:
    """The kind of an output written before forge marked its outputs, where its files show it:
    an image–caption dataset holds only its manifest (a format of forge's own) and the files
    it lists. (An unmarked export is not recognised: ``save_pretrained`` writes the same
    files, and replacing a user's model is what the markers exist to prevent.)"""
    names = {p.name for p in folder.iterdir()}
    listed = image_dataset_files(folder / MANIFEST)
    if listed is not None and names == listed | {MANIFEST}:
        return OutputKind.IMAGE_TEXT_DATASET
    return None


def image_dataset_files(manifest: pathlib.Path) -> set[str] | None:
    """The files an image–caption dataset's manifest lists (token shards, images, offsets);
    None when ``manifest`` is not one."""
    try:
        raw = json.loads(manifest.read_text(encoding="utf-8"))
        files = {s["file"] for split in raw["splits"].values() for s in split["shards"]}
        for images in raw["images"].values():
            files |= {images["file"], images["offsets"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return {f for f in files if isinstance(f, str)}


def written_kind(folder: pathlib.Path) -> OutputKind | None:
    """What forge wrote in ``folder``: its marker's kind, else what its files show."""
    return marked_kind(folder) or unmarked_kind(folder)


def enclosing_run(path: pathlib.Path) -> pathlib.Path | None:
    """``path`` or the nearest folder above it that is a run directory (``config.toml`` beside
    ``checkpoints/`` or ``metrics.jsonl``) or a checkpoint directory (``latest``), if any."""
    for folder in (path, *path.parents):
        if (folder / "config.toml").is_file() and (
            (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file()
        ):
            return folder
        if (folder / "latest").is_symlink() and marked_kind(folder) is None:
            return folder
    return None


def enclosing_dataset(path: pathlib.Path) -> pathlib.Path | None:
    """The nearest folder above ``path`` that holds a prepared dataset (``manifest.json``)."""
    return next((f for f in path.parents if (f / "manifest.json").is_file()), None)


def output_problem(out: pathlib.Path, kind: OutputKind, overwrite: bool) -> str | None:
    """Why a script may not write ``kind`` into ``out`` (one line naming ``--out``), or None:
    it is new or empty, or holds this script's own earlier output and ``overwrite`` is set."""
    resolved = out.resolve()
    if out.exists() and not out.is_dir():
        return (
            f"--out {out}: cannot write the {kind.noun} there: a file of that name exists; "
            "choose another --out"
        )
    run = enclosing_run(resolved)
    own_export = kind is OutputKind.HF_EXPORT and run is not None and resolved == run / "export"
    if run is not None and not own_export:  # checkpoint.export_final writes <run>/export
        return (
            f"--out {out}: lies in the run or checkpoint directory {run}; write the output "
            "outside it (forge never adds to a run's folders)"
        )
    dataset = None if own_export else enclosing_dataset(resolved)
    if dataset is not None:
        return f"--out {out}: lies inside the dataset {dataset}; choose a folder outside it"
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if written_kind(out) is not kind:
        names = sorted(p.name for p in out.iterdir())
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return (
            f"--out {out}: holds files forge did not write there ({shown}); choose a new or "
            "empty folder"
        )
    if not overwrite:
        return (
            f"--out {out}: holds an earlier {kind.noun} written by forge; pass --overwrite to "
            "replace it, or choose another --out"
        )
    return None


def file_output_problem(
    out: pathlib.Path, option: str, own_folder: str, is_own: Callable[[pathlib.Path], bool]
) -> str | None:
    """Why a script may not write the file ``out`` (one line naming ``option``), or None. The
    rules of the output folders, for one file: never a folder, never inside a run or
    checkpoint directory (except the script's own ``<run>/<own_folder>/``) or a dataset, and
    never over a file the script did not write (``is_own`` recognises its own)."""
    resolved = out.resolve()
    if out.is_dir():
        return f"{option} {out}: is a folder; name the file to write"
    run = enclosing_run(resolved.parent)
    if run is not None and not resolved.is_relative_to(run / own_folder):
        return (
            f"{option} {out}: lies in the run or checkpoint directory {run}; write it outside "
            f"(or under {run / own_folder}): forge never adds to a run's own folders"
        )
    dataset = enclosing_dataset(resolved)
    if dataset is not None:
        return f"{option} {out}: lies inside the dataset {dataset}; choose a file outside it"
    if out.exists() and not out.is_file():  # a FIFO or a device: never read, never written
        return f"{option} {out}: is not a regular file (a pipe or a device); name a file"
    if out.exists() and not is_own(out):
        return f"{option} {out}: holds a file forge did not write there; choose a new file name"
    folder = next((p for p in (out.parent, *out.parent.parents) if p.exists()), None)
    if folder is None or not folder.is_dir():
        return f"{option} {out}: {folder} is not a folder"
    if not os.access(folder, os.W_OK):
        return f"{option} {out}: {folder} is not writable"
    return None


def temporary_sibling(out: pathlib.Path) -> pathlib.Path:
    """A fresh, hidden folder beside ``out`` to write into (this process's own name)."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


@contextlib.contextmanager
def staged_output(out: pathlib.Path) -> Iterator[pathlib.Path]:
    """A ``temporary_sibling`` of ``out`` to write into, removed on the way out (already gone
    when ``replace_output`` renamed it into place; nothing left behind after a failure)."""
    tmp = temporary_sibling(out)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_output(tmp: pathlib.Path, out: pathlib.Path, kind: OutputKind) -> pathlib.Path:
    """Mark ``tmp`` as ``kind`` and rename it to ``out``, moving an earlier ``out`` (checked
    by ``output_problem``) aside first and deleting it only once the new one is in place."""
    (tmp / MARKER).write_text(kind.value + "\n")
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None:  # the earlier output goes back where it was
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def replace_file(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling renamed over it: a full disk or a
    file-size limit leaves the earlier file as it was, and no temporary behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
