"""The base of every error caused by user input (config, data, checkpoint)."""

from __future__ import annotations

import errno
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
    if isinstance(exc, UserInputError):  # forge's own lines, whole (a long one capped)
        text = "; ".join(" ".join(line.split()) for line in exc.lines)[:1000]
    else:
        text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


NO_SPACE = "no space left on the device"
# the OS errors of a write that found no room: a full file system, a user's quota spent
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found no space: an ``OSError`` ENOSPC or EDQUOT itself,
    or one it was raised from or while handling (torch's zip writer reports its stream's
    failed write as ``unexpected pos``, the ``OSError`` as its context), or DCP's report of
    one on any rank."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in SPACE_ERRNOS:
            return True
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # DCP: each failing rank's exception (and traceback)
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    pending.append(inner)
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return False


def short_write(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's report of a write that came up short (``[enforce fail at
    inline_container.cc:...] unexpected pos``): a full disk or a file-size limit. Where torch
    opened the file itself, or the error crossed a process, no ``OSError`` says which."""
    return "unexpected pos" in str(exc)


def no_space(cause: str) -> str:
    """``cause``, a save's failure in one line, marked as a lack of space (the mark survives
    the exchange between ranks, which carries text; ``CheckpointSaveError`` reads it)."""
    return f"{NO_SPACE}: {cause}"


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (full disk, file-size limit, I/O error). The
    temporary directory is removed; ``remains`` says what was found of the previous
    checkpoint and ``latest`` after the failure (intact, or what is gone)."""

    def __init__(
        self, root: str, step: int, cause: str, remains: str, abandoned: bool = False
    ) -> None:
        self.root, self.step, self.cause = root, step, cause
        self.abandoned = abandoned  # given up on while its write still runs
        what = f"({cause})"
        if cause.startswith(NO_SPACE):
            what = (
                f"({cause}): free space on the disk that holds {root} (delete what it no "
                "longer needs, or lower checkpoint.keep_last_n) or point checkpoint.dir at a "
                "disk with room"
            )
        ends = (
            "; its write could not be stopped, so the run ends: relaunch it once the store "
            "answers (it resumes from the last committed checkpoint)"
            if abandoned
            else ""
        )
        super().__init__(
            f"checkpoint.dir {root}: saving step {step} failed {what}; {remains}{ends}"
        )

    @property
    def run_ends_line(self) -> str:
        """The line of a failure that ends the run: what failed, then what to do (a failure
        given up on says it already)."""
        if self.abandoned:
            return str(self)
        return (
            f"{self}; the run ends: relaunch it once that is mended (it resumes from the last "
            "committed checkpoint)"
        )


def print_errors(lines: Sequence[str], stream: TextIO | None = None) -> None:
    """Each line as ``error: <line>``, written whole in one call: several ranks share one
    stderr pipe, and a line written in pieces can interleave with another rank's."""
    out = stream if stream is not None else sys.stderr
    for line in lines:
        out.write(f"error: {line}\n")
    out.flush()
