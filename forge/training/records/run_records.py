"""What a run directory records beside its checkpoints: the resolved config, with its history,
``metrics.jsonl`` aligned with the resumed step (what a resume takes out is kept in
``metrics.superseded.jsonl``), and ``checkpoints.jsonl``, every committed step, which a start
checks against the checkpoints it finds (``lost_checkpoints_problem``).

``config.toml`` is the config the run started with and is never overwritten by a resume. A
resume whose resolved config differs from the one in force writes ``config.step_N.toml`` (N:
the step it resumed at), the config from step N on; a resume at an earlier step drops the
files of the steps it discards, as it drops their metrics. Every file is replaced atomically:
a full disk or a file-size limit leaves the earlier one as it was.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import time
from collections.abc import Callable, Collection, Mapping

import attrs

from forge.errors import UserInputError
from forge.jsonl import open_lines
from forge.metrics.sinks import trim_records_after
from forge.outputs import replace_file

CONFIG_FILE = "config.toml"
STEP_CONFIG = re.compile(r"config\.step_([1-9]\d*)\.toml")  # as step_config_file writes it


def step_config_file(step: int) -> str:
    """The name of the config in force from resumed step ``step`` on."""
    return f"config.step_{step}.toml"


def recorded_configs(run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
    """The run's configs by the step each applies from (0: ``config.toml``)."""
    found: dict[int, pathlib.Path] = {}
    if (run_dir / CONFIG_FILE).is_file():
        found[0] = run_dir / CONFIG_FILE
    if run_dir.is_dir():
        for path in run_dir.iterdir():
            match = STEP_CONFIG.fullmatch(path.name)
            if match and path.is_file():
                found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def config_in_force(run_dir: pathlib.Path) -> pathlib.Path | None:
    """The config the run last trained under: its newest ``config.step_N.toml``, else
    ``config.toml``; None for a folder that holds no run."""
    configs = recorded_configs(run_dir)
    return configs[max(configs)] if configs else None


@attrs.frozen
class ConfigRecord:
    """What a start at ``step`` writes of its config: a file name (None: the one in force
    already says it) and the files of later steps to drop (a branch the resume discards)."""

    write: str | None
    drop: tuple[str, ...] = ()


def config_record(recorded: Mapping[int, str], step: int, text: str) -> ConfigRecord:
    """Decide from the recorded configs' texts (by step) what a start at ``step`` with the
    resolved config ``text`` writes. A fresh start (step 0) writes ``config.toml``."""
    drop = tuple(step_config_file(n) for n in sorted(recorded) if n > step)
    kept = {n: t for n, t in recorded.items() if n <= step}
    if step == 0:
        return ConfigRecord(CONFIG_FILE if kept.get(0) != text else None, drop)
    if not kept:  # config.toml gone: this config is the resumed steps' only, not the run's
        return ConfigRecord(step_config_file(step), drop)
    if kept[max(kept)] == text:
        return ConfigRecord(None, drop)
    return ConfigRecord(step_config_file(step), drop)


def unrecorded_configs_note(recorded: Collection[int], step: int) -> str | None:
    """The warning of a resume at ``step`` whose first steps' config is recorded nowhere
    (``config.toml`` deleted): up to the earliest recorded config at or before ``step``, or
    to ``step`` itself, whose config is then recorded as ``config.step_N.toml``, not as the
    run's (``config_record``)."""
    if step == 0 or 0 in recorded:
        return None
    earlier = [n for n in recorded if n <= step]
    if earlier:
        return f"{CONFIG_FILE} is gone: the config of steps 1-{min(earlier)} is recorded nowhere"
    return (
        f"{CONFIG_FILE} is gone: the config of steps 1-{step} is recorded nowhere; this "
        f"launch's is recorded as {step_config_file(step)}, the config from step {step} on"
    )


class RunRecordsError(UserInputError):
    """The run directory's records could not be written (a full disk, a file-size limit)."""


def write_run_records(
    run_dir: pathlib.Path,
    metrics_path: pathlib.Path,
    step: int,
    config_text: str,
    rewound_from: int | None = None,
    as_recorded: Callable[[str], str] = str,
) -> str | None:
    """Trim ``metrics.jsonl`` to ``step``, then record the config (see ``config_record``, which
    compares ``config_text`` with each recorded text as ``as_recorded`` reads it) and, for a
    start that went back from step ``rewound_from`` on purpose, that decision; returns the
    problem, naming the file and the OS error, when one cannot be read or written. Each
    write is atomic, so a failure leaves that file as it was."""
    configs = recorded_configs(run_dir)
    recorded: dict[int, str] = {}
    for n, path in configs.items():
        try:
            recorded[n] = as_recorded(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            return (
                f"run.dir: cannot read {path} ({reason(exc)}); restore it, or move it away to "
                "record this run's config afresh"
            )
    record = config_record(recorded, step, config_text)
    target = metrics_path
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        trim_records_after(metrics_path, step)
        if record.write is not None:
            target = run_dir / record.write
            replace_file(target, config_text)
        for name in record.drop:
            target = run_dir / name
            target.unlink(missing_ok=True)
        if rewound_from is not None:
            target = run_dir / COMMITS_FILE
            record_commit(run_dir, step, rewound_from)
    except OSError as exc:
        return (
            f"run.dir: cannot write {target} ({reason(exc)}); free space on that disk or raise "
            "the file-size limit (ulimit -f), then run again"
        )
    return None


def reason(exc: OSError | UnicodeDecodeError) -> str:
    """The OS's words for ``exc`` (its strerror), else the exception's own."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


class LostCheckpointsError(UserInputError):
    """The run's records go past its newest committed checkpoint (``lost_checkpoints_problem``)."""


COMMITS_FILE = "checkpoints.jsonl"  # one line per committed checkpoint, appended by rank 0


def record_commit(run_dir: pathlib.Path, step: int, rewound_from: int | None = None) -> None:
    """Append a committed checkpoint's step (or, with ``rewound_from``, a start that went back
    to ``step`` on purpose) to the run's record of commits; synced, so that a crash loses at
    most the line being written."""
    entry: dict[str, object] = {"step": step, "time": round(time.time(), 3)}
    if rewound_from is not None:
        entry["rewound_from"] = rewound_from
    with open_lines(run_dir / COMMITS_FILE) as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def last_recorded_commit(run_dir: pathlib.Path) -> int | None:
    """The step of the run's last recorded commit (or accepted rewind); None when it records
    none. A line torn by a crash, or damaged, is passed over."""
    try:
        raw = (run_dir / COMMITS_FILE).read_bytes()
    except OSError:
        return None
    last = None
    for line in raw.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and type(entry.get("step")) is int:
            last = entry["step"]
    return last


def lost_checkpoints_problem(
    recorded: int | None, newest: int | None, run_dir: pathlib.Path, checkpoint_dir: object
) -> str | None:
    """Why a start must not go on: the run's records say step ``recorded`` was committed, but
    the newest committed checkpoint is older (``newest``; None: there is none). Starting from it
    would train those steps again over records that say they were done."""
    if recorded is None or (newest is not None and newest >= recorded):
        return None
    found = f"the newest committed one is step_{newest}" if newest is not None else "none is left"
    start = f"step_{newest}" if newest is not None else "step 0"
    return (
        f"run.dir: {run_dir} records a committed checkpoint of step {recorded} "
        f"({COMMITS_FILE}), but in {checkpoint_dir} {found}: checkpoints were deleted or the "
        "store lost them. Restore them to resume at step "
        f"{recorded}; to go on from {start} on purpose, pass --checkpoint.allow_rewind=true "
        "(the records past it are kept in metrics.superseded.jsonl); or choose a new --run.dir"
    )
