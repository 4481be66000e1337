"""What ``scripts/eval_follow.py`` does next, decided from what it sees, and the record it keeps.

The follower's record is ``<run dir>/eval_follow.jsonl``: one line per step and *what* (``loss``,
the held-out loss, or an lm-eval task's name), written whole and synced, so a result is either
recorded or not. A step retention removed before the follower reached it gets a line too,
``skipped`` with the reason: nothing passes without a record, and nothing recorded is done
again. No torch here: the decision is a function of a ``FollowView``.
"""

from __future__ import annotations

import enum
import json
import math
import os
import pathlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

RESULTS_FILE = "eval_follow.jsonl"
LOCK_FILE = ".forge.eval_follow.lock"
LOSS = "loss"  # the held-out loss's name among what is evaluated
REMOVED = "removed by retention before the follower reached it"
INCOMPLETE = "its checkpoint is there but incomplete (damaged: no commit marker)"


class FollowAction(enum.Enum):
    EVALUATE = "evaluate"  # the step is committed and has results missing
    SKIP = "skip"  # the step was committed and is gone: recorded as skipped
    WAIT = "wait"  # nothing to do until the next commit
    STOP = "stop"  # the run completed and every step asked for has its record


@attrs.frozen
class Decision:
    action: FollowAction
    step: int | None = None
    missing: tuple[str, ...] = ()  # what the step still lacks (EVALUATE, SKIP)
    reason: str | None = None  # why a step is skipped (SKIP)


@attrs.frozen
class FollowView:
    """What one look at the run shows: the complete checkpoints in its checkpoint directory,
    the steps its record of commits names (``checkpoints.jsonl``, rewinds applied), the
    (step, what) pairs already recorded, and the step the run completes at."""

    committed: frozenset[int]
    recorded: frozenset[int]
    done: frozenset[tuple[int, str]]
    final_step: int
    trainer_running: bool = False  # a trainer holds the run: it may go on past final_step
    incomplete: frozenset[int] = frozenset()  # committed, still there, damaged


def wanted(step: int, every: int, final_step: int) -> bool:
    """Whether ``step`` is one the follower evaluates: a multiple of ``every`` (1: every
    committed step), and the run's last step whatever ``every`` is."""
    return step > 0 and (step % every == 0 or step == final_step)


def next_action(view: FollowView, what: tuple[str, ...], every: int) -> Decision:
    """The oldest wanted step with a result missing: evaluated if its checkpoint is there,
    recorded as skipped if it was committed and is gone; else stop once the final step has
    every result and no trainer runs (a resume may be taking the run further), else wait."""
    for step in sorted(view.committed | view.recorded):
        if not wanted(step, every, view.final_step):
            continue
        missing = tuple(w for w in what if (step, w) not in view.done)
        if not missing:
            continue
        if step in view.committed:
            return Decision(FollowAction.EVALUATE, step, missing)
        reason = INCOMPLETE if step in view.incomplete else REMOVED
        return Decision(FollowAction.SKIP, step, missing, reason)
    if not view.trainer_running and all((view.final_step, w) in view.done for w in what):
        return Decision(FollowAction.STOP)
    return Decision(FollowAction.WAIT)


def recorded_steps(entries: Iterable[Mapping[str, Any]]) -> frozenset[int]:
    """The committed steps a run's record of commits names: a rewind to step R (a start that
    went back on purpose) takes back the steps after R recorded before it."""
    steps: set[int] = set()
    for entry in entries:
        step = entry.get("step")
        if type(step) is not int:
            continue
        if "rewound_from" in entry:
            steps = {s for s in steps if s <= step}
        steps.add(step)
    return frozenset(steps)


def json_lines(path: pathlib.Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; torn or damaged lines passed over; none if absent."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def rewinds_of(entries: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(step gone back to, when) of each rewind a run's record of commits holds."""
    return [
        (e["step"], float(e["time"]))
        for e in entries
        if "rewound_from" in e and type(e.get("step")) is int and is_number(e.get("time"))
    ]


def is_number(value: Any) -> bool:
    return type(value) in (int, float)


def damaged_lines(path: pathlib.Path) -> int:
    """How many lines of a JSONL file are not JSON objects (a torn last line is cut first)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return 0
    count = 0
    for line in raw.splitlines():
        try:
            ok = isinstance(json.loads(line), dict)
        except ValueError:
            ok = False
        count += not ok and bool(line.strip())
    return count


def done_pairs(
    records: Iterable[Mapping[str, Any]], rewinds: Iterable[tuple[int, float]] = ()
) -> frozenset[tuple[int, str]]:
    """The (step, what) pairs the follower's records hold, evaluated or skipped; a record of
    a step that a later rewind went back before is of a checkpoint that is no more (the step
    is trained again: its new checkpoint gets a record of its own)."""
    rewinds = list(rewinds)

    def current(r: Mapping[str, Any]) -> bool:
        when = r.get("time")
        if not isinstance(when, int | float):  # no time (or a damaged one): cannot tell
            return True
        return all(r["step"] <= s or when >= t for s, t in rewinds)

    return frozenset(
        (r["step"], r["what"])
        for r in records
        if type(r.get("step")) is int and isinstance(r.get("what"), str) and current(r)
    )


def repair_tail(path: pathlib.Path) -> None:
    """Cut a last line a killed writer left without its newline, so the next line starts a
    line of its own (the cut line was never a result: it is passed over when read)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return
    if raw and not raw.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(raw.rfind(b"\n") + 1)
            os.fsync(f.fileno())


def append_record(path: pathlib.Path, record: Mapping[str, Any]) -> None:
    """One record as one line, in one write, synced: it is in the file whole or not at all
    (``repair_tail`` cuts what a kill in the middle of the write left)."""
    line = (json.dumps(dict(record), allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def loss_record(step: int, loss: float, tokens: int, checkpoint: str) -> dict[str, Any]:
    """The held-out loss's line, keyed as in-loop evaluation logs it."""
    finite = math.isfinite(loss) and loss < 700  # beyond it, the perplexity overflows
    return {
        "step": step,
        "what": LOSS,
        "eval/loss": loss if math.isfinite(loss) else None,
        "eval/perplexity": math.exp(loss) if finite else None,
        "eval/tokens": tokens,
        "checkpoint": checkpoint,
        "time": round(time.time(), 3),
    }


def task_record(step: int, task: str, scores: Mapping[str, float], checkpoint: str) -> dict:
    """One task's line: its ``eval/<task>/<metric>`` scores, as in-loop evaluation logs them."""
    return {
        "step": step,
        "what": task,
        **scores,
        "checkpoint": checkpoint,
        "time": round(time.time(), 3),
    }


def skipped_record(step: int, what: str, reason: str) -> dict[str, Any]:
    return {"step": step, "what": what, "skipped": reason, "time": round(time.time(), 3)}


def follow_line(follow: bool, interval: int, run_dir: pathlib.Path) -> str | None:
    """The start-up line of a run that evaluates beside the loop (``eval.follow``): where its
    evaluation happens, and the command that does it."""
    if not follow:
        return None
    steps = f"every {interval} steps" if interval > 0 else "every committed step"
    return (
        f"eval.follow: no evaluation in the loop; the follower evaluates the checkpoints of "
        f"{steps}: python scripts/eval_follow.py {run_dir}"
    )
