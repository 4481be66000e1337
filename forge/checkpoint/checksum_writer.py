"""DCP's file writer, checksumming each shard while it is written (synchronous saves).

A shard's 4 MiB pieces (``integrity.PIECE``) are CRC-32'd from the page cache as soon as the
write has passed them, in background threads (zlib releases the GIL), so the checksums overlap
the rest of the write: a synchronous save waits only for the last piece of each shard instead
of reading the whole checkpoint back once it is written. The bytes checksummed are the file's,
not the writer's buffers, as in a read-back. The small files (``.metadata``, the RNG states)
are still checksummed after the write (``integrity.checksums_of``). Also here: how a save
gets its shards' checksums, from this writer or read back after an async write.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageWriter

from forge.checkpoint.integrity import (
    PIECE,
    checksum_threads,
    checksums_of,
    crc_of_range,
    own_files,
)
from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.rng import RngFile


class PieceHasher:
    """The pieces of one file being written, each checksummed once the write passed it."""

    def __init__(self, path: pathlib.Path, pool: ThreadPoolExecutor) -> None:
        self.path = path
        self.pool = pool
        self.pieces: list[Future[str]] = []
        self.size = 0

    @property
    def next_boundary(self) -> int:
        return (len(self.pieces) + 1) * PIECE

    def written(self, size: int) -> None:
        """The file now holds ``size`` bytes (flushed): checksum every whole piece below it."""
        self.size = size
        while size >= self.next_boundary:
            self.pieces.append(
                self.pool.submit(crc_of_range, self.path, len(self.pieces) * PIECE, PIECE)
            )

    def finish(self) -> None:
        """The file is complete: checksum its last, partial piece."""
        start = len(self.pieces) * PIECE
        if self.size > start:
            self.pieces.append(self.pool.submit(crc_of_range, self.path, start, self.size - start))

    def result(self) -> list[Any]:
        """``[length, [crc of each piece]]``, as ``integrity.checksums_of`` records it."""
        return [self.size, [piece.result() for piece in self.pieces]]


class HashingStream:
    """A file being written that tells its ``PieceHasher`` each time it passes a piece."""

    def __init__(self, raw: Any, hasher: PieceHasher) -> None:
        self.raw = raw
        self.hasher = hasher

    def write(self, data: Any) -> int:
        n = self.raw.write(data)
        end = self.raw.tell()
        if end >= self.hasher.next_boundary:
            self.raw.flush()  # the piece's bytes must reach the file before it is read
            self.hasher.written(end)
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed


class HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every ``.distcp`` shard it writes."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self.pool = pool
        self.hashers: dict[str, PieceHasher] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        path = pathlib.Path(path)
        if "w" not in mode or path.suffix != ".distcp":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        hasher = PieceHasher(path, self.pool)
        with path.open(mode) as raw:
            yield HashingStream(raw, hasher)
        hasher.written(path.stat().st_size)  # closed: every byte is in the file
        hasher.finish()
        self.hashers[path.name] = hasher


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` whose shards are checksummed while written (``checksums``)."""

    def __init__(self, path: str | os.PathLike, pool: ThreadPoolExecutor) -> None:
        super().__init__(path)
        self.fs = HashingFileSystem(pool)

    def checksums(self) -> dict[str, list[Any]]:
        """The shards written: ``{name: [length, [crc of each piece]]}`` (waits for them)."""
        assert isinstance(self.fs, HashingFileSystem)
        return {name: hasher.result() for name, hasher in self.fs.hashers.items()}


def hashing_pool() -> ThreadPoolExecutor:
    """The threads that checksum shard pieces during a synchronous save."""
    return ThreadPoolExecutor(max_workers=checksum_threads(), thread_name_prefix="forge-crc")


def written_shards(writer: StorageWriter) -> Callable[[], Mapping[str, list]]:
    """How to get the checksums a writer took of the shards as it wrote them (none: they
    are read back with the small files)."""
    return writer.checksums if isinstance(writer, ChecksummingWriter) else dict


def written_checksums(
    write: Future, tmp: CheckpointPath, rank: int, rng: RngFile | None = None
) -> dict[str, list]:
    """After the write ``write`` completes (its error raised here), and the RNG file ``rng``
    is written when given, this rank's checksums of the files it wrote into ``tmp``."""
    write.result()
    if rng is not None:
        rng.write()
    return checksums_of(tmp, own_files(tmp, rank))
