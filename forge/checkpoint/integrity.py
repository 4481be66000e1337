"""What a committed checkpoint's bytes must be: a CRC-32 and a length for every file it holds,
recorded in ``checksums.json`` at commit and verified before a resume loads anything.

Each rank checksums the files it wrote (its shards and RNG file, rank 0 also ``.metadata``)
right after writing them, while they are still in the page cache; rank 0 adds the train state
and writes the record last, before the checkpoint is renamed into place. CRC-32 (zlib, the
fastest checksum in the standard library) is not a defence against an attacker, which the
loader's refusal to unpickle code is; it catches what happens to files by accident: a flipped
bit, a truncated or swapped shard, a hand-edited train state.
"""

from __future__ import annotations

import json
import pathlib
import re
import zlib
from collections.abc import Iterable, Mapping

from forge.config.checkpoint import Verification
from forge.errors import UserInputError

CHECKSUMS = "checksums.json"
CHECKSUMS_VERSION = 1
CHUNK = 8 << 20  # bytes read at a time


class IntegrityError(UserInputError):
    """A checkpoint's bytes are not those it was committed with."""


def file_checksum(path: pathlib.Path) -> tuple[int, str]:
    """``(length, crc32 as 8 hex digits)`` of the file at ``path``."""
    crc, size = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def own_files(folder: pathlib.Path, rank: int) -> list[str]:
    """The files of a checkpoint being written that rank ``rank`` wrote: its DCP shards
    (``__<rank>_<n>.distcp``), its RNG state, and for rank 0 the DCP metadata."""
    shard = re.compile(rf"__{rank}_\d+\.distcp")
    names = [p.name for p in folder.iterdir() if p.is_file() and shard.fullmatch(p.name)]
    names += [n for n in (f"rng_rank{rank}.pt",) if (folder / n).is_file()]
    if rank == 0 and (folder / ".metadata").is_file():
        names.append(".metadata")
    return sorted(names)


def checksums_of(folder: pathlib.Path, names: Iterable[str]) -> dict[str, list]:
    """``{name: [length, crc32]}`` of the files ``names`` in ``folder``."""
    return {name: list(file_checksum(folder / name)) for name in names}


def write_checksums(folder: pathlib.Path, sums: Mapping[str, list]) -> None:
    """Record ``sums`` in ``folder/checksums.json``, with a checksum of every other file of
    ``folder`` that ``sums`` lacks (so that nothing in a committed checkpoint goes unchecked).
    Written to a temporary name and renamed."""
    every = dict(sums)
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name not in every and not path.name.startswith(CHECKSUMS):
            every[path.name] = list(file_checksum(path))
    record = {"version": CHECKSUMS_VERSION, "algorithm": "crc32", "files": every}
    tmp = folder / f"{CHECKSUMS}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(folder / CHECKSUMS)


def recorded_checksums(folder: pathlib.Path) -> dict[str, list] | None:
    """The checksums recorded at commit; None for a checkpoint written before forge recorded
    them. A record that does not parse is an ``IntegrityError``."""
    path = folder / CHECKSUMS
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        if record.get("algorithm") != "crc32" or not isinstance(files, dict):
            raise ValueError("not a crc32 record")
        return {str(k): [int(v[0]), str(v[1])] for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise IntegrityError(f"{path}: unreadable checksum record ({exc})") from None


def verify_checkpoint(folder: pathlib.Path, mode: Verification = Verification.FULL) -> bool:
    """Check every file ``checksums.json`` lists against it (lengths only under
    ``METADATA``); an ``IntegrityError`` naming the first that differs. False when the
    checkpoint has no record (written before forge kept one), True when it verified."""
    sums = recorded_checksums(folder)
    if sums is None:
        return False
    for name, (length, crc) in sorted(sums.items()):
        path = folder / name
        where = f"{folder.name}/{name}"
        if not path.is_file():
            raise IntegrityError(f"{where}: missing (recorded at commit)")
        size = path.stat().st_size
        if size != length:
            raise IntegrityError(f"{where}: {size} bytes, {length} when committed")
        if mode is Verification.FULL and file_checksum(path)[1] != crc:
            raise IntegrityError(f"{where}: checksum mismatch (its bytes changed after commit)")
    return True
