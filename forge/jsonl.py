"""JSON-lines record files that a run appends to (``metrics.jsonl``, ``goodput.jsonl``,
``checkpoints.jsonl``, the superseded records): their readers pass over a line a crash cut
short, so an append must never continue one. A record glued to a cut line would be lost with
it — and with it what the record says (a commit that start-up checks against, a launch of the
ledger)."""

from __future__ import annotations

import os
import pathlib
import stat
from typing import BinaryIO, TextIO


def open_lines(path: pathlib.Path) -> TextIO:
    """``path`` opened to append text lines (created when missing), at the start of a line."""
    f = path.open("a+", encoding="utf-8")
    try:
        f.write(line_break(f.fileno()))
    except OSError:
        f.close()
        raise
    return f


def open_byte_lines(path: pathlib.Path) -> BinaryIO:
    """``path`` opened to append byte lines (created when missing), at the start of a line."""
    f = path.open("ab+")
    try:
        f.write(line_break(f.fileno()).encode())
    except OSError:
        f.close()
        raise
    return f


def line_break(fd: int) -> str:
    """What ends the cut last line of the regular file open at ``fd`` (a crash mid-write
    leaves no newline at its end): ``"\\n"``; nothing when it ends a line, is empty, or is
    not a regular file (a pipe has no last byte to read)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
        return ""
    return "" if os.pread(fd, 1, info.st_size - 1) == b"\n" else "\n"
