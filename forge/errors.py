"""The base of every error caused by user input (config, data, checkpoint)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO


class UserInputError(ValueError):
    """Bad input: each line names the thing (key, file, checkpoint) and the fix. Exit code 2."""

    def __init__(self, lines: str | Sequence[str]) -> None:
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))


def one_line(exc: BaseException) -> str:
    """The cause of ``exc`` in one line, for an ``error:`` message. DCP's
    ``CheckpointException`` carries each failing rank's exception with its traceback; the
    first rank's exception is named instead of the whole report."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = min(failures.items(), key=lambda item: item[0])
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return f"rank {rank}: {one_line(inner)}"
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{type(exc).__name__}: {exc.strerror}{where}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (full disk, file-size limit, I/O error). The previous
    checkpoint and ``latest`` are intact and the temporary directory is removed."""

    def __init__(self, root: str, step: int, cause: str) -> None:
        self.root, self.step, self.cause = root, step, cause
        super().__init__(
            f"checkpoint.dir {root}: saving step {step} failed ({cause}); the previous "
            "checkpoint and 'latest' are intact"
        )


def print_errors(lines: Sequence[str], stream: TextIO | None = None) -> None:
    """Each line as ``error: <line>``, written whole in one call: several ranks share one
    stderr pipe, and a line written in pieces can interleave with another rank's."""
    out = stream if stream is not None else sys.stderr
    for line in lines:
        out.write(f"error: {line}\n")
    out.flush()
