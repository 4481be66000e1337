"""A script's console that goes away: a pipe whose reader closed (``| head``), a terminal
that hung up, a full device. What is written there is dropped from then on and the script
goes on — a training run's record is its files and checkpoints, the console only echoes it.
Without this, a closed pipe ended a run in a ``BrokenPipeError`` traceback at whichever
``print`` met it first, with its records and its ledger's last line unwritten."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

# what a console that went away answers a write with: its pipe's reader closed (or its
# socket's), its terminal hung up, its device or file is full or past its size limit
GONE = frozenset(
    {errno.EPIPE, errno.ECONNRESET, errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
)


class DroppingStream:
    """``stream``, dropping what is written once a write or flush finds it gone (``GONE``): its
    descriptor is pointed at ``/dev/null`` then, so no later flush of its buffer (the
    interpreter's at exit included) fails again."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except OSError as exc:
                self.drop(exc)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except OSError as exc:
                self.drop(exc)

    def drop(self, exc: OSError) -> None:
        if exc.errno not in GONE:
            raise exc
        self.gone = True
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self.stream.fileno())
            finally:
                os.close(null)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def console_may_close() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as ``DroppingStream``s inside the block (a decorator
    of every script's ``main``); flushed, then put back, on the way out."""
    saved = sys.stdout, sys.stderr
    out, err = DroppingStream(saved[0]), DroppingStream(saved[1])
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    try:
        yield
    finally:
        out.flush()
        err.flush()
        sys.stdout, sys.stderr = saved
