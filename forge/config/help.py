"""``train.py --help``: usage, how overrides work, the exit codes and every key with its
default."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from forge.config.sections import FreezeRule, JobConfig
from forge.types import ExitCode

ARRAY_ENTRIES: dict[str, type] = {"freeze": FreezeRule}  # arrays of tables, by JobConfig field

EXIT_MEANINGS = {
    ExitCode.OK: "done: completed, already complete, or the data ran out (train.max_epochs)",
    ExitCode.CONFIG_ERROR: "bad config, data or checkpoint: nothing was trained",
    ExitCode.NAN_ABORT: "too many consecutive non-finite steps",
    ExitCode.HEALTH_FAILURE: "health failure: a rank stalled or died",
    ExitCode.SAVE_FAILED: "a final or emergency save (or the last step's) failed",
    ExitCode.REPLAY_MISMATCH: (
        "a rank computes inconsistently (resilience.replay_interval): suspect its hardware"
    ),
    ExitCode.FLOAT8_DRIFT: (
        "an FP8 step drifted from high precision (train.float8_on_drift='stop')"
    ),
    ExitCode.SHUTDOWN: "preempted: resume by running the same command again",
    ExitCode.INTERRUPTED: (
        "interrupted twice (Ctrl-C): the save in progress was abandoned; or once during set-up"
    ),
}

USAGE = "usage: train.py CONFIG.toml [--section.key=value ...]"


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if value is None:
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)


def help_text() -> str:
    """``train.py --help``: usage, how overrides work, and every key with its default."""
    lines = [
        USAGE,
        "",
        "Train from a TOML config (e.g. configs/train/debug.toml). Any key can be overridden on",
        "the command line, the value in TOML syntax: --train.max_steps=600,",
        "--optimizer.betas=[0.9,0.95], --train.mixed_precision=fp32. Exit codes:",
        *(f"  {code.value:>3}  {EXIT_MEANINGS[code]}" for code in ExitCode),
        "Every key is documented in docs/configuration.md. Keys and defaults:",
    ]
    defaults = JobConfig()
    for section in attrs.fields(JobConfig):
        value = getattr(defaults, section.name)
        if attrs.has(type(value)):
            lines.append(f"  [{section.name}]")
            lines += [f"    {k} = {_shown(v)}" for k, v in _fields(value)]
        else:  # an array of tables ([[freeze]]): none by default; show one entry's keys
            lines.append(f"  [[{section.name}]]  (none by default; each entry has these keys)")
            lines += [f"    {f.name}" for f in attrs.fields(ARRAY_ENTRIES[section.name])]
    return "\n".join(lines)


def _fields(value: Any) -> list[tuple[str, Any]]:
    return [(f.name, getattr(value, f.name)) for f in attrs.fields(type(value))]
