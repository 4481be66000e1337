"""``[checkpoint]``: when and how checkpoints are written, kept, resumed and exported."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from forge.config.ranges import (
    Problem,
    non_negative,
    not_empty,
    positive,
    store_options_problem,
    timeout_range,
    url_scheme,
    usable_location,
)


class AsyncMode(enum.Enum):
    DISABLED = "disabled"  # the loop waits for every save
    ASYNC = "async"  # stage (copy) the state, write it in a background thread
    ASYNC_PROCESS = "async_process"  # stage into shared memory, write in a checkpoint process


class Verification(enum.Enum):
    """How much of a checkpoint a resume verifies before loading it (``checkpoint.verify``)."""

    FULL = "full"  # every file's length and CRC-32 (reads the whole checkpoint once)
    METADATA = "metadata"  # every file's length only (for very large checkpoints)


class ScheduleSource(enum.Enum):
    """``checkpoint.schedule_from``: which LR schedule a resume with a changed one follows."""

    CHECKPOINT = "checkpoint"  # the recorded one, as if nothing had changed
    CONFIG = "config"  # the configured one, from the resume step on


class ExportDtype(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


@attrs.frozen
class DynamicWindow:
    """Power-of-two milestones: inside [start, stop] save at start, start+1, start+2, start+4..."""

    start: int = 0
    stop: int = 512

    def problems(self, prefix: str) -> list[Problem]:
        p: list[Problem] = []
        non_negative(p, f"{prefix}.start", self.start)
        if self.stop < self.start:
            p.append((f"{prefix}.stop", f"must be >= start={self.start}, got {self.stop}"))
        return p


EXCLUDABLE = frozenset({"optimizer"})  # what checkpoint.exclude_from_loading may name


@attrs.frozen
class CheckpointConfig:
    """DCP checkpoints. ``dir`` defaults to ``<run.dir>/checkpoints``; ``keep_last_n`` <= 0 keeps
    all. ``load_path`` is used as initial weights only when ``dir`` holds no checkpoint."""

    enabled: bool = True
    dir: str | None = None
    interval: int = 1000
    async_mode: AsyncMode = AsyncMode.DISABLED
    dyn_ckpt_window: DynamicWindow | None = None
    keep_last_n: int = 3
    load_path: str | None = None
    load_optimizer: bool = False  # with load_path: also take its optimizer state
    # resume even if the model or data order differs from the checkpoint's (with a warning)
    allow_config_change: bool = False
    # start from the newest committed checkpoint (or afresh) although the run's records say a
    # later step was committed (checkpoints deleted on purpose, or lost by a store)
    allow_rewind: bool = False
    export_final: bool = False  # the final save also writes <run.dir>/export (safetensors)
    export_dtype: ExportDtype = ExportDtype.BFLOAT16
    # what a resume checks of a checkpoint's bytes before loading it: every file's length and
    # checksum ("full"), or lengths only ("metadata", for very large checkpoints)
    verify: Verification = Verification.FULL
    # what a resume leaves out of the checkpoint: ["optimizer"] starts a fresh optimizer (to
    # change the optimizer or its settings); weights, data position and step are kept
    exclude_from_loading: tuple[str, ...] = ()
    # which LR schedule a resume follows when lr, [scheduler] or max_steps changed: the
    # "checkpoint"'s, or the "config"'s from the resume step; unset: such a resume is refused
    schedule_from: ScheduleSource | None = None
    # fsspec's storage options for a ``dir`` or ``load_path`` in an object store (endpoint,
    # credentials, ...); unset: the store's standard environment (AWS_* for S3)
    storage_options: dict[str, Any] = attrs.field(factory=dict)
    # how long forge waits for the object store to answer one call (a listing, a small
    # object): a store that accepts connections but never answers is named after this, not
    # after its client's timeouts times its retries (minutes)
    storage_timeout_s: float = 30.0

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        not_empty(p, "checkpoint.dir", self.dir)
        not_empty(p, "checkpoint.load_path", self.load_path)
        usable_location(p, "checkpoint.dir", self.dir)
        usable_location(p, "checkpoint.load_path", self.load_path)
        remote = [v for v in (self.dir, self.load_path) if v and url_scheme(v)]
        for url in remote[:1]:
            if (problem := store_options_problem(url, self.storage_options)) is not None:
                p.append(("checkpoint.storage_options", problem))
        if self.storage_options and not remote:
            p.append(
                (
                    "checkpoint.storage_options",
                    "is set, but neither checkpoint.dir nor checkpoint.load_path is a URL "
                    "(s3://...); remove it or give the URL",
                )
            )
        if self.export_final and not self.enabled:  # an output asked for, never written
            p.append(
                (
                    "checkpoint.export_final",
                    "writes the export with the final save, and checkpoint.enabled is false; "
                    "set checkpoint.enabled = true, or remove it",
                )
            )
        positive(p, "checkpoint.interval", self.interval)
        timeout_range(p, "checkpoint.storage_timeout_s", self.storage_timeout_s)
        if self.dyn_ckpt_window is not None:
            p += self.dyn_ckpt_window.problems("checkpoint.dyn_ckpt_window")
        unknown = sorted(set(self.exclude_from_loading) - EXCLUDABLE)
        if unknown:
            p.append(
                (
                    "checkpoint.exclude_from_loading",
                    f"can name {sorted(EXCLUDABLE)}, got {unknown}",
                )
            )
        return p
