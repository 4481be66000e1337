"""A checkpoint location in an object store (``s3://bucket/prefix``, ``gs://...``, any fsspec
protocol), with the part of ``pathlib.Path``'s interface the checkpoint readers use: joining,
names, existence, listing, sizes, opening. An object store has no folders: a "directory" is a
key prefix, ``mkdir`` does nothing and a directory exists while an object lies under it.

Listings are never cached (``use_listings_cache=False``): another rank, or the DCP writer's
own file-system object, writes objects this process must see at once.

A path with ``timeout_s`` (``checkpoint.storage_timeout_s``) waits that long for each call
and then raises ``StoreTimeoutError``: a store that accepts connections but never answers
would otherwise hold the caller for its client's timeouts times its retries (minutes for
s3fs over botocore), and a signal with it (``answered_within``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import io
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs
from fsspec import AbstractFileSystem, filesystem
from fsspec.core import split_protocol

from forge.errors import UserInputError

P = ParamSpec("P")
T = TypeVar("T")
WAIT_SLICE_S = 0.1  # the longest a bounded wait goes without running the signal handlers
S3_PROTOCOLS = frozenset({"s3", "s3a"})


class StoreTimeoutError(TimeoutError, UserInputError):
    """A call to an object store that did not return within the path's ``timeout_s``: the
    store accepts connections but does not answer. An ``OSError``, as the store's other
    failures (every caller that handles a failed read or write handles it), and bad input
    to a script that meets it (one line, exit 2: the endpoint configured does not answer)."""

    def __init__(self, line: str) -> None:
        UserInputError.__init__(self, line)  # OSError's own would leave ``lines`` unset


def no_answer(path: str, endpoint: str | None, timeout_s: float) -> StoreTimeoutError:
    where = f"at {endpoint}" if endpoint else "at its default endpoint"
    return StoreTimeoutError(
        f"{path}: the store {where} did not answer within checkpoint.storage_timeout_s="
        f"{timeout_s:g} s; check that the endpoint is the store's and that it is up "
        "(AWS_ENDPOINT_URL or checkpoint.storage_options for S3), or raise "
        "checkpoint.storage_timeout_s for a store that is slow to answer"
    )


class _NoAnswer(Exception):
    """``answered_within``'s time ran out (private: the call's own ``TimeoutError`` is not it)."""


def answered_within(seconds: float, call: Callable[[], T]) -> T:
    """``call()`` on a thread of its own, waited for ``seconds`` at most; raises what it
    raised, or ``_NoAnswer``. The wait is cut in short slices: a signal delivered to another
    thread is only handled when the main thread runs Python again, and set-up's handler stops
    set-up (``forge.resilience.signals``). A call given up on is left to finish or fail on its
    daemon thread: nothing waits for it, and the process that gave up exits."""
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller, whatever it is
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="forge-store-call", daemon=True).start()
    deadline = time.monotonic() + seconds
    while not done.wait(min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise _NoAnswer
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def result_while_answering(future: Future[T], where: Any) -> T:
    """``future.result()`` for a write into ``where``: on an object store with a timeout,
    waited for in slices of ``timeout_s``, the store asked between them whether it answers
    (``exists``, itself bounded). A write held by a store that stopped answering raises
    ``StoreTimeoutError`` within two timeouts, instead of holding the caller as long as the
    store is silent (its client's timeouts times its retries, or for ever); a slow write to a
    store that answers is waited for in full. Elsewhere: waited for plainly."""
    timeout_s = where.timeout_s if isinstance(where, ObjectPath) else None
    if timeout_s is None:
        return future.result()
    while True:
        done, _ = wait_futures([future], timeout=timeout_s)
        if done:  # its own outcome, a timeout of its own calls included
            return future.result()
        try:
            where.exists()
        except StoreTimeoutError:
            raise
        except OSError:  # an answer, if an error: the write reports its own failure
            pass


def store_endpoint(protocol: str, options: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    """The endpoint a store's requests go to, as far as forge can tell without asking the
    store's client: its storage options', else (S3) the standard variables'; None: the
    client's default (AWS for S3)."""
    client = options.get("client_kwargs")
    for value in (
        options.get("endpoint_url"),
        client.get("endpoint_url") if isinstance(client, Mapping) else None,
    ):
        if value:
            return str(value)
    if protocol in S3_PROTOCOLS:
        return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    return None


def store_call(
    method: Callable[Concatenate[ObjectPath, P], T],
) -> Callable[Concatenate[ObjectPath, P], T]:
    """``method``, waited for at most the path's ``timeout_s``, with the store's own errors
    (no credentials, no connection, options the store rejects) raised as ``OSError``, like a
    file system's: every caller that handles a failed read or write handles them."""

    @functools.wraps(method)
    def call(path: ObjectPath, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return path.answer(lambda: method(path, *args, **kwargs))
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
    # how long each call waits for the store (checkpoint.storage_timeout_s); None: as long as
    # the store's client takes, retries included
    timeout_s: float | None = attrs.field(default=None, eq=False, repr=False)

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

    @property
    def endpoint(self) -> str | None:
        return store_endpoint(self.protocol, self.options, os.environ)

    def answer(self, call: Callable[[], T]) -> T:
        """``call()`` (requests to this store), waited for at most ``timeout_s``; raises
        ``StoreTimeoutError`` naming the store when it does not return in time."""
        if self.timeout_s is None:
            return call()
        try:
            return answered_within(self.timeout_s, call)
        except _NoAnswer:
            raise no_answer(str(self), self.endpoint, self.timeout_s) from None

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


def object_path(
    url: str, options: Mapping[str, Any] | None = None, timeout_s: float | None = None
) -> ObjectPath:
    """The ``ObjectPath`` of ``url`` (``protocol://bucket/prefix``), each call waiting at most
    ``timeout_s`` for the store. Using it raises ``ImportError`` when the protocol's package is
    not installed, ``ValueError`` for an unknown protocol
    (``forge.config.ranges.store_url_problem`` says so first)."""
    protocol, key = split_protocol(url)
    return ObjectPath(protocol or "file", str(key).rstrip("/"), dict(options or {}), timeout_s)
