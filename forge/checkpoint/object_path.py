"""A checkpoint location in an object store (``s3://bucket/prefix``, ``gs://...``, any fsspec
protocol), with the part of ``pathlib.Path``'s interface the checkpoint readers use: joining,
names, existence, listing, sizes, opening. An object store has no folders: a "directory" is a
key prefix, ``mkdir`` does nothing and a directory exists while an object lies under it.

Listings are never cached (``use_listings_cache=False``): another rank, or the DCP writer's
own file-system object, writes objects this process must see at once.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import io
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

import attrs
from fsspec import AbstractFileSystem, filesystem
from fsspec.core import split_protocol

P = ParamSpec("P")
T = TypeVar("T")


def store_call(method: Callable[P, T]) -> Callable[P, T]:
    """``method``, with the store's own errors (no credentials, no connection, options the
    store rejects) raised as ``OSError``, like a file system's: every caller that handles a
    failed read or write handles them."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(*args, **kwargs)
        except OSError:
            raise
        except Exception as exc:
            raise OSError(f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc

    return call


@attrs.frozen
class ObjectStat:
    st_size: int


@attrs.frozen
class ObjectPath:
    """``protocol://key``; ``options`` are fsspec's storage options for the store (DCP's
    fsspec reader and writer open it with the same). Nothing is opened until first used."""

    protocol: str
    key: str
    options: Mapping[str, Any] = attrs.field(eq=False, repr=False, factory=dict)

    @property
    def fs_options(self) -> dict[str, Any]:
        """What the store's file system is opened with: no listing cache, and ``options``
        (DCP's fsspec reader and writer open it with the same, so share its instance)."""
        return {"use_listings_cache": False, **self.options}

    @property
    def fs(self) -> AbstractFileSystem:
        """The store's file system (fsspec keeps one instance per protocol and options; the
        credentials and endpoint it read from the environment stay those of its first use)."""
        return filesystem(self.protocol, **self.fs_options)

    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __truediv__(self, name: str) -> ObjectPath:
        return attrs.evolve(self, key=f"{self.key}/{name}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return attrs.evolve(self, key=self.key.rsplit("/", 1)[0]) if "/" in self.key else self

    @property
    def url(self) -> str:
        return str(self)

    def resolve(self) -> ObjectPath:
        return self

    @store_call
    def exists(self) -> bool:
        return bool(self.fs.exists(self.key))

    @store_call
    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.key))

    @store_call
    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.key))

    def is_symlink(self) -> bool:
        return False

    @store_call
    def iterdir(self) -> Iterator[ObjectPath]:
        """The objects and prefixes directly under this one (none when it holds nothing)."""
        try:
            entries = self.fs.ls(self.key, detail=False)
        except FileNotFoundError:
            return iter(())
        names = sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})
        return iter([self / n for n in names if n and f"{self.key}/{n}" != self.key])

    @store_call
    def file_sizes(self) -> dict[str, int]:
        """The size of each object directly under this prefix, in one listing."""
        try:
            entries = self.fs.ls(self.key, detail=True)
        except FileNotFoundError:
            return {}
        return {
            str(e["name"]).rsplit("/", 1)[-1]: int(e["size"])
            for e in entries
            if e.get("type") == "file" and str(e["name"]).rstrip("/") != self.key
        }

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        return iter([p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)])

    @store_call
    def stat(self) -> ObjectStat:
        return ObjectStat(int(self.fs.size(self.key) or 0))

    @store_call
    def open(self, mode: str = "r") -> Any:
        return self.fs.open(self.key, mode)

    @store_call
    def read_bytes(self) -> bytes:
        return as_bytes(self.fs.cat_file(self.key))

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    @store_call
    def read_range(self, offset: int, length: int) -> bytes:
        return as_bytes(self.fs.cat_file(self.key, start=offset, end=offset + length))

    @store_call
    def write_bytes(self, data: bytes) -> None:
        """One object, complete or absent: stores never show a half-written one."""
        self.fs.pipe_file(self.key, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    @store_call
    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    @store_call
    def remove_tree(self) -> None:
        """Every object under this prefix."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key, recursive=True)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Prefixes need no creating."""

    def stream(self) -> io.BytesIO:
        """The whole object in memory, seekable (for ``torch.load``)."""
        return io.BytesIO(self.read_bytes())


def as_bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else data


def object_path(url: str, options: Mapping[str, Any] | None = None) -> ObjectPath:
    """The ``ObjectPath`` of ``url`` (``protocol://bucket/prefix``). Using it raises
    ``ImportError`` when the protocol's package is not installed, ``ValueError`` for an
    unknown protocol (``forge.config.ranges.store_url_problem`` says so first)."""
    protocol, key = split_protocol(url)
    return ObjectPath(protocol or "file", str(key).rstrip("/"), dict(options or {}))
