"""Where step metrics go: stdout and a JSONL file (one JSON object per logged step)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Mapping
from typing import Any, Protocol, TextIO


class MetricsSink(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


def format_record(record: Mapping[str, Any]) -> str:
    """One human-readable line: ``step 10 | loss 2.3456 | ...``."""
    parts = []
    for key, value in record.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        parts.append(f"{key} {shown}")
    return " | ".join(parts)


class StdoutSink:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def write(self, record: Mapping[str, Any]) -> None:
        print(format_record(record), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends to ``path``; a resumed run continues the same file."""

    def __init__(self, path: pathlib.Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def write(self, record: Mapping[str, Any]) -> None:
        self.file.write(json.dumps(dict(record)) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def trim_records_after(path: pathlib.Path, step: int) -> int:
    """Drop records logged after ``step`` (by a run that crashed past its last checkpoint), so
    that a resumed run's file reads as one uninterrupted run. Returns how many were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a crash mid-write
            dropped += 1
            continue
        if record.get("step", 0) > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped
