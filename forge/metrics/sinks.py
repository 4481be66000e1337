"""Where step metrics go: stdout and a JSONL file (one JSON object per logged step)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
from collections.abc import Mapping
from typing import Any, Protocol, TextIO

from forge.jsonl import open_byte_lines, open_lines
from forge.outputs import replace_file
from forge.types import LoopState, StepResult


class MetricsSink(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


def sink_failure(sink: MetricsSink, exc: OSError, step: int) -> str | None:
    """What was lost when ``sink`` could not write step ``step``'s record, naming the config
    key and the OS error (a run stops rather than train on unrecorded); None for the console
    (it only echoes what the files keep)."""
    key = getattr(sink, "config_key", None)
    if key is None:
        return None
    where = getattr(sink, "path", None)
    return (
        f"{key}: cannot write {where or 'its records'} ({exc.strerror or exc}): the records "
        f"from step {step} on are lost"
    )


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


def format_duration(seconds: float) -> str:
    """``45s``, ``3m12s``, ``2h05m``: short enough for a progress line."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(record: Mapping[str, Any], max_steps: int) -> str:
    """``step 120/400 | loss 2.3456 | 5,120 tok/s | ETA 3m12s`` from a step record."""
    step = int(record["step"])
    eta = (max_steps - step) * float(record.get("step_time", math.nan))
    return (
        f"step {step}/{max_steps} | loss {record['loss']:.4f} | "
        f"{record.get('tokens_per_sec', 0.0):,.0f} tok/s | ETA {format_duration(eta)}"
    )


class ProgressSink:
    """For an interactive terminal: one line, rewritten in place at every logged step; other
    records (eval, per-source) print as lines of their own above it."""

    def __init__(self, stream: TextIO, max_steps: int) -> None:
        self.stream = stream
        self.max_steps = max_steps
        self.pending = False  # a progress line is on screen without its newline

    def write(self, record: Mapping[str, Any]) -> None:
        if "loss" in record and "step_time" in record:
            self.stream.write(f"\r{progress_line(record, self.max_steps)}\x1b[K")
            self.pending = True
        else:
            self.stream.write(f"\r\x1b[K{format_record(record)}\n")
            self.pending = False
        self.stream.flush()

    def close(self) -> None:
        if self.pending:
            self.stream.write("\n")
            self.stream.flush()
            self.pending = False


def console_sink(stream: TextIO, max_steps: int) -> MetricsSink:
    """A progress line on a terminal, plain lines otherwise (SLURM logs stay greppable)."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return ProgressSink(stream, max_steps)
    return StdoutSink(stream)


class JsonlSink:
    """Appends to ``path``; a resumed run continues the same file."""

    config_key = "metrics.jsonl"

    def __init__(self, path: pathlib.Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open_lines(path)

    def write(self, record: Mapping[str, Any]) -> None:
        self.file.write(json.dumps(dict(record)) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def superseded_path(path: pathlib.Path) -> pathlib.Path:
    """Where ``trim_records_after`` keeps the records it takes out of ``path``."""
    return path.with_name(f"{path.stem}.superseded{path.suffix}")


def trim_records_after(path: pathlib.Path, step: int) -> int:
    """Take out records logged after ``step`` (by a run that crashed past its last checkpoint),
    and lines that are not a JSON object (torn by a crash, or damaged bytes), so that a resumed
    run's file reads as one uninterrupted run. Nothing is lost: what is taken out is appended
    to ``superseded_path(path)`` first (the work a fault cost, for whoever audits the run).
    Returns how many records were taken out."""
    if not path.is_file():
        return 0
    kept, dropped = [], []
    for raw in path.read_bytes().splitlines():
        if not raw.strip():
            continue
        try:  # bytes, not text: one damaged line must not stop the resume
            line = raw.decode("utf-8")
            record = json.loads(line)
        except ValueError:  # a line torn by a crash mid-write, or damaged bytes
            dropped.append(raw)
            continue
        recorded = record.get("step", 0) if isinstance(record, dict) else None
        if type(recorded) is not int or recorded > step:  # no record, or one past the resume
            dropped.append(raw)
        else:
            kept.append(line)
    if dropped:
        with open_byte_lines(superseded_path(path)) as archive:
            archive.write(b"".join(raw + b"\n" for raw in dropped))
            archive.flush()
            os.fsync(archive.fileno())
        replace_file(path, "".join(line + "\n" for line in kept))
    return len(dropped)


def step_record(
    state: LoopState, result: StepResult, step_time: float, tokens_per_sec: float
) -> dict[str, Any]:
    """The metrics one logged step writes (``z_loss`` only when the z-loss is on,
    ``images_per_sec`` only for a vision-language step)."""
    record: dict[str, Any] = {"step": state.step, "loss": result.loss}
    if result.z_loss is not None:
        record["z_loss"] = result.z_loss
    record |= {
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "tokens_seen": state.tokens_seen,
        "tokens_per_sec": tokens_per_sec,
        "step_time": step_time,
    }
    if result.images:
        record["images_per_sec"] = result.images / step_time if step_time > 0 else math.inf
    return record
