"""The goodput ledger: where a run's wall time went, across every launch (pure; the clock that
fills it is ``forge.training.loop.ledger``).

Each launch appends its running totals to ``<run.dir>/goodput.jsonl`` (rank 0, at each logged
step and at its end), one JSON line each: a SIGKILL loses at most the tail since its last line,
never an earlier launch. ``run_totals`` reads every launch's last line and adds them up:

- a launch's own buckets, measured where the time is spent (``Bucket``);
- ``recomputed`` also takes the productive time a launch spent past its last save (killed,
  its node lost, or ended without a final save): the next launch trains those steps again —
  unless it was a replica group's (``[fault_tolerance]``), whose peers kept them;
- ``down``: the time between one launch's last line and the next launch's start (a process
  killed, the scheduler's relaunch), which no launch could measure — unless that launch
  completed the run: the time until a later launch extends it (a longer ``train.max_steps``)
  is not the run's, neither down nor wall.

So the buckets add up to the run's wall time, from its first launch's start to its last
line, up to what each launch did not time; ``goodput`` = productive / wall.
"""

from __future__ import annotations

import enum
import json
import math
import pathlib
import time
from collections.abc import Iterable, Mapping

import attrs

LEDGER_FILE = "goodput.jsonl"


class Bucket(enum.Enum):
    """Where a second of a launch went."""

    IMPORTS = "imports"  # process start to the script's main: the interpreter, its imports
    SETUP = "setup"  # main to the loop: config, process group, model, data (less the below)
    LOAD = "load"  # resolving and loading the checkpoint resumed from
    VERIFY = "verify"  # checking its bytes against their checksums
    PRODUCTIVE = "productive"  # steps whose update the run keeps
    DROPPED = "dropped"  # steps whose update was dropped (non-finite, a spike)
    RECOMPUTED = "recomputed"  # steps trained again: rolled back, or lost past a commit
    CHECKPOINT = "checkpoint"  # the loop blocked on saves, snapshots and their wait
    EVALUATION = "evaluation"
    LOADER = "loader"  # waiting for the next batch
    HANG = "hang"  # a failed collective or a stalled peer: the time to detect it
    LOGGING = "logging"  # records, the per-step control word (all answered), hooks
    SHUTDOWN = "shutdown"  # after the loop: the final wait, closing, teardown
    DOWN = "down"  # between launches: no process of the run was timing


@attrs.frozen
class LaunchRecord:
    """One launch's running totals, as its last line says."""

    launch: str  # its start time and rank 0's pid: unique per launch
    started: float  # unix time the process started
    wall: float  # seconds from ``started`` to this line
    step: int  # the step reached
    uncommitted: float  # productive seconds since the last save began (lost if it died)
    ended: bool  # the launch wrote its last line at its end (not killed)
    seconds: Mapping[str, float]  # by ``Bucket`` value
    # a replica group's launch ([fault_tolerance]): its peers kept the steps past its last
    # save, so a death loses none of them
    replicated: bool = False
    completed: bool = False  # it ended with the run complete (to its train.max_steps)


def launch_id(started: float, pid: int) -> str:
    """A launch's id: its start time and rank 0's pid."""
    return f"{started:.3f}-{pid}"


def launched_by(record: LaunchRecord, pid: int | None) -> bool:
    """Whether ``record`` is the launch whose rank 0 has ``pid``."""
    return pid is not None and record.launch.endswith(f"-{pid}")


def launch_line(record: LaunchRecord) -> str:
    """The JSON line ``record`` is appended as."""
    return json.dumps(attrs.asdict(record)) + "\n"


def read_ledger(path: pathlib.Path, now: float | None = None) -> list[LaunchRecord]:
    """Every launch's last record, in the order the launches started; a torn or damaged line
    is passed over (the launch's previous line stands), and so is a line that ends more than
    ``FUTURE_SLACK_S`` after ``now`` (default: the time of reading). Only a regular file is
    read (a FIFO would block the reader)."""
    return ledger_lines(path, now)[0]


def ledger_lines(path: pathlib.Path, now: float | None = None) -> tuple[list[LaunchRecord], int]:
    """``read_ledger``'s launches, and how many of the file's lines it passed over."""
    last: dict[str, LaunchRecord] = {}
    try:
        raw = path.read_bytes() if path.is_file() else b""
    except OSError:
        return [], 0
    limit = (time.time() if now is None else now) + FUTURE_SLACK_S
    passed_over = 0
    for line in raw.splitlines():
        try:
            record = LaunchRecord(**json.loads(line))
        except (ValueError, TypeError):
            passed_over += 1
            continue
        if well_formed(record) and record.started + record.wall <= limit:
            last[record.launch] = record
        else:
            passed_over += 1
    return sorted(last.values(), key=lambda r: r.started), passed_over


# a line that ends later than this past the time it is read was not written by a launch (the
# clocks of a run's hosts differ by far less): its gap would count as the run's down time
FUTURE_SLACK_S = 3600.0


BUCKETS = frozenset(b.value for b in Bucket)


def well_formed(record: LaunchRecord) -> bool:
    """Whether a parsed line is one a launch writes: finite, non-negative numbers (a
    launch's lost work no more than its productive time), known buckets, booleans where
    they belong (a damaged or hand-edited line is passed over like a torn one, never added
    up)."""
    if not isinstance(record.seconds, dict):
        return False
    numbers = [record.started, record.wall, record.uncommitted, *record.seconds.values()]
    productive = record.seconds.get(Bucket.PRODUCTIVE.value, 0.0)
    return (
        isinstance(record.launch, str)
        and type(record.step) is int
        and record.step >= 0
        and type(record.ended) is bool
        and type(record.replicated) is bool
        and type(record.completed) is bool
        and set(record.seconds) <= BUCKETS
        and all(seconds_value(x) for x in numbers)
        and record.uncommitted <= productive + ROUNDING_S
    )


ROUNDING_S = 0.01  # each value is written to the millisecond


def seconds_value(x: object) -> bool:
    """Whether ``x`` is a number of seconds a launch writes: finite, not negative (an
    integer too large for a float is not one)."""
    if type(x) not in (int, float):
        return False
    try:
        return math.isfinite(float(x)) and float(x) >= 0  # type: ignore[arg-type]
    except OverflowError:
        return False


def run_totals(
    launches: Iterable[LaunchRecord], running: LaunchRecord | None = None
) -> dict[Bucket, float]:
    """The run's seconds by bucket, every launch's added up (see the module docstring);
    ``running``: the launch still training, whose steps past its last save are not lost
    yet."""
    totals = dict.fromkeys(Bucket, 0.0)
    previous_end: float | None = None
    for record in [*launches, *([running] if running is not None else [])]:
        for name, seconds in record.seconds.items():
            totals[Bucket(name)] += seconds
        # trained again: lost with it (not after a finished run, saved or not: it was done)
        if record is not running and not record.replicated and not record.completed:
            totals[Bucket.PRODUCTIVE] -= record.uncommitted
            totals[Bucket.RECOMPUTED] += record.uncommitted
        if previous_end is not None:
            totals[Bucket.DOWN] += max(0.0, record.started - previous_end)
        previous_end = None if record.completed else record.started + record.wall
    return totals


def goodput(totals: Mapping[Bucket, float]) -> float:
    """Productive seconds over all of them (0 for an empty ledger)."""
    wall = sum(totals.values())
    return totals[Bucket.PRODUCTIVE] / wall if wall > 0 else 0.0


def run_wall(launches: list[LaunchRecord]) -> float:
    """Seconds from the first launch's start to the last launch's last line, less the time
    between a launch that completed the run and the next (the run was done)."""
    wall, start, end = 0.0, None, 0.0
    for record in launches:
        if start is None:
            start, end = record.started, record.started + record.wall
        else:
            end = max(end, record.started + record.wall)
        if record.completed:
            wall, start = wall + end - start, None
    return wall + (end - start if start is not None else 0.0)


def summary_line(totals: Mapping[Bucket, float], launches: int) -> str:
    """``goodput 0.81 over 3 launches, 42.0 s: productive 34.1 s, setup 4.2 s, ...``: the
    buckets that hold a tenth of a second or more, largest first."""
    wall = sum(totals.values())
    parts = sorted(
        ((s, b.value) for b, s in totals.items() if s >= 0.05 and b is not Bucket.PRODUCTIVE),
        reverse=True,
    )
    spent = ", ".join(f"{name} {s:.1f} s" for s, name in parts)
    productive = totals[Bucket.PRODUCTIVE]
    return (
        f"goodput {goodput(totals):.2f} over {launches} launch{'es' if launches != 1 else ''}, "
        f"{wall:.1f} s: productive {productive:.1f} s" + (f", {spent}" if spent else "")
    )


def ledger_metrics(totals: Mapping[Bucket, float]) -> dict[str, float]:
    """The run's ledger as metrics: ``goodput`` and ``goodput/<bucket>_s``."""
    return {
        "goodput": goodput(totals),
        **{f"goodput/{b.value}_s": round(s, 3) for b, s in totals.items()},
    }
