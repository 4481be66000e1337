"""What a committed checkpoint's bytes must be: the length of every file it holds and a CRC-32
of each 4 MiB piece of it (``PIECE``), recorded in ``checksums.json`` at commit and verified
before a resume loads anything.

Each rank checksums the files it wrote (its shards and RNG file, rank 0 also ``.metadata``):
in a synchronous save the shards while DCP writes them (``checksum_writer``), the small files
right after; in the async modes all of them in the background once written, while still in
the page cache; rank 0 adds the train state and writes the record last, before the checkpoint
is renamed into place. CRC-32 (zlib, the fastest checksum in the standard library; it
releases the GIL) is not a defence against an attacker, which the loader's refusal to unpickle
code is; it catches what happens to files by accident: a flipped bit, a truncated or swapped
shard, a hand-edited train state. Pieces are checksummed in parallel threads, so a large
shard costs its read time divided by the cores.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import attrs

from forge.checkpoint.object_path import ObjectPath
from forge.checkpoint.paths import CheckpointPath, file_sizes, write_atomically
from forge.config.checkpoint import Verification
from forge.errors import UserInputError

CHECKSUMS = "checksums.json"
CHECKSUMS_VERSION = 1
# bytes per CRC-32: the unit of parallel work, and what a synchronous save checksums as soon
# as DCP has written it (small enough that a shard's checksums overlap its write). A record
# names its piece size: checkpoints written with 32 MiB pieces verify as they were written.
PIECE = 4 << 20


class IntegrityError(UserInputError):
    """A checkpoint's bytes are not those it was committed with."""


def checksums_of(
    folder: CheckpointPath, names: Iterable[str], piece: int | None = None
) -> dict[str, list]:
    """``{name: [length, [crc32 of each piece]]}`` of the files ``names`` in ``folder``, in
    pieces of ``piece`` bytes (``PIECE``): each memory-mapped (no copy; in an object store,
    a ranged read) and checksummed in parallel threads."""
    piece = piece or PIECE
    names = list(names)
    sizes = file_sizes(folder) if isinstance(folder, ObjectPath) and names else {}
    sums: dict[str, list] = {}
    with ThreadPoolExecutor(max_workers=checksum_threads()) as pool:
        for name in names:
            path = folder / name
            size = sizes[name] if name in sizes else path.stat().st_size
            pieces = [
                pool.submit(crc_of_range, path, offset, min(piece, size - offset))
                for offset in range(0, size, piece)
            ]
            sums[name] = [size, [piece.result() for piece in pieces]]
    return sums


def crc_of_range(path: CheckpointPath, offset: int, length: int) -> str:
    """The CRC-32 of ``length`` bytes of ``path`` from ``offset`` (a multiple of the page
    size, as a piece's is), memory-mapped: no copy (an object: one ranged read)."""
    if isinstance(path, ObjectPath):
        return crc_hex(path.read_range(offset, length))
    with (
        path.open("rb") as f,
        mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=offset) as m,
        memoryview(m) as view,  # released before its map closes
    ):
        return crc_hex(view)


def checksum_threads() -> int:
    """Threads for checksumming: the cores this process may run on, at most 4 (each rank of a
    node checksums its own files at the same time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def crc_hex(data: memoryview | bytes) -> str:
    """The CRC-32 of ``data`` as 8 hex digits."""
    return f"{zlib.crc32(data):08x}"


def own_files(folder: CheckpointPath, rank: int) -> list[str]:
    """The files of a checkpoint being written that rank ``rank`` wrote: its DCP shards
    (``__<rank>_<n>.distcp``), its RNG state, and for rank 0 the DCP metadata."""
    shard = re.compile(rf"__{rank}_\d+\.distcp")
    present = file_sizes(folder)
    names = [n for n in present if shard.fullmatch(n)]
    names += [n for n in (f"rng_rank{rank}.pt",) if n in present]
    if rank == 0 and ".metadata" in present:
        names.append(".metadata")
    return sorted(names)


def write_checksums(folder: CheckpointPath, sums: Mapping[str, list]) -> None:
    """Record ``sums`` in ``folder/checksums.json``, with a checksum of every other file of
    ``folder`` that ``sums`` lacks (so that nothing in a committed checkpoint goes unchecked).
    Written whole or not at all (``write_atomically``)."""
    rest = [n for n in sorted(file_sizes(folder)) if n not in sums and not n.startswith(CHECKSUMS)]
    every = {**sums, **checksums_of(folder, rest)}
    record = {"version": CHECKSUMS_VERSION, "algorithm": "crc32", "piece": PIECE, "files": every}
    write_atomically(folder / CHECKSUMS, json.dumps(record, indent=1, sort_keys=True).encode())


@attrs.frozen
class Record:
    """A committed checkpoint's ``checksums.json``: its piece size and each file's sums."""

    piece: int
    files: dict[str, list]


def recorded_checksums(folder: CheckpointPath) -> Record | None:
    """The checksums recorded at commit; None for a checkpoint written before forge recorded
    them. A record that does not parse, or is not one forge writes, is an ``IntegrityError``
    naming what is wrong with it."""
    path = folder / CHECKSUMS
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"{path}: unreadable checksum record ({exc})") from None
    problem = record_problem(record)
    if problem is not None:
        raise IntegrityError(f"{path}: {problem}")
    files = {str(k): [int(v[0]), [str(c) for c in v[1]]] for k, v in record["files"].items()}
    return Record(record["piece"], files)


def record_problem(record: object) -> str | None:
    """What makes ``record`` (parsed JSON) not a checksum record forge can verify, or None."""
    if not isinstance(record, dict):
        return f"not a checksum record (a JSON {type(record).__name__}, not an object)"
    algorithm = record.get("algorithm")
    if algorithm != "crc32":
        return f"checksum algorithm {algorithm!r} is not one forge verifies ('crc32')"
    if not usable_piece(record.get("piece")):
        return f"piece size {record.get('piece')!r} is not a positive whole number of pages"
    files = record.get("files")
    if not isinstance(files, dict):
        return "its 'files' is not a table of file names"
    for name, entry in files.items():
        well_formed = (
            isinstance(entry, list)
            and len(entry) == 2
            and type(entry[0]) is int
            and entry[0] >= 0
            and isinstance(entry[1], list)
            and all(isinstance(c, str) and len(c) == 8 for c in entry[1])
        )
        if not well_formed:
            return f"the entry of {name!r} is not [length, [8-hex-digit CRC-32 of each piece]]"
    return None


def unrecorded_files(present: Iterable[str], recorded: Iterable[str]) -> list[str]:
    """The files ``present`` in a checkpoint that a record does not list (the record itself
    aside): added or renamed after commit, and so unchecked if they were let through."""
    listed = set(recorded)
    return sorted(n for n in present if not n.startswith(CHECKSUMS) and n not in listed)


def usable_piece(piece: object) -> bool:
    """A piece size checksums can be read back in: a positive whole number of pages."""
    return type(piece) is int and piece > 0 and piece % mmap.ALLOCATIONGRANULARITY == 0


def verify_checkpoint(folder: CheckpointPath, mode: Verification = Verification.FULL) -> bool:
    """Check every file ``checksums.json`` lists against it (lengths only under
    ``METADATA``), and that it lists every file of the folder (it fails closed: an empty or
    partial record is damage); an ``IntegrityError`` naming the first that differs. False
    when the checkpoint has no record (written before forge kept one), True when it
    verified."""
    record = recorded_checksums(folder)
    if record is None:
        return False
    sums = record.files
    present = file_sizes(folder)  # one listing: in an object store, one request
    unlisted = unrecorded_files(present, sums)
    if unlisted:
        shown = ", ".join(unlisted[:3]) + (
            f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
        )
        raise IntegrityError(
            f"{folder.name}: {shown} not in its checksum record (added or renamed after "
            "commit, or the record lost entries): its bytes cannot be verified"
        )
    for name, (length, _) in sorted(sums.items()):
        where = f"{folder.name}/{name}"
        if name not in present:
            raise IntegrityError(f"{where}: missing (recorded at commit)")
        size = present[name]
        if size != length:
            raise IntegrityError(f"{where}: {size} bytes, {length} when committed")
    if mode is Verification.METADATA:
        return True
    now = checksums_of(folder, sorted(sums), record.piece)
    for name in sorted(sums):
        if now[name][1] != sums[name][1]:
            raise IntegrityError(
                f"{folder.name}/{name}: checksum mismatch (its bytes changed after commit)"
            )
    return True
