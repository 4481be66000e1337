"""The one resume resolver every entry point uses.

Precedence: (1) the newest complete checkpoint in ``checkpoint.dir`` (auto-resume: model,
optimizer, train state), whatever ``latest`` names (an older target is named, not followed); (2)
else ``checkpoint.load_path`` as initial weights (model only); (3) else a fresh start.
Incomplete checkpoints are reported and skipped, never returned; a complete-looking one that
fails to load (truncated shards, bytes that do not match their checksums, a train state of
another step) gives way to the next of every other complete ``step_*`` directory, newest first
(``fallbacks``).
"""

from __future__ import annotations

import enum
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import torch
from torch import nn

from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.policy import step_of
from forge.checkpoint.safety import UnsafeCheckpointError
from forge.checkpoint.storage import LATEST, storage_of
from forge.checkpoint.store import (
    CheckpointError,
    ShapeMismatchError,
    is_complete,
    latest_step,
    list_steps,
    load_checkpoint,
    newest_complete,
    step_dir,
)


class ResumeSource(enum.Enum):
    CHECKPOINT_DIR = "checkpoint_dir"  # full state: continue the run
    LOAD_PATH = "load_path"  # weights only: a new run from given initial weights
    FRESH = "fresh"


@attrs.frozen
class ResumePlan:
    source: ResumeSource
    path: CheckpointPath | None = None
    skipped: tuple[CheckpointPath, ...] = ()  # incomplete checkpoints newer than ``path``
    fallbacks: tuple[CheckpointPath, ...] = ()  # every other complete checkpoint, newest first
    # said once when ``latest`` names something other than ``path``: what, and why not it
    latest_note: str | None = None


def newest_committed(plan: ResumePlan) -> int | None:
    """The step of the newest committed checkpoint the resolver found (loadable or not); None
    when it found none to resume."""
    if plan.source is not ResumeSource.CHECKPOINT_DIR or plan.path is None:
        return None
    return max(step_of(p.name) or 0 for p in (plan.path, *plan.fallbacks))


def latest_problem(checkpoint_dir: CheckpointPath) -> str | None:
    """Why ``checkpoint_dir/latest`` names no checkpoint of this directory to resume from
    (dangling, a loop, outside the directory, not a step folder, incomplete), or None when it
    names one, or does not exist."""
    target = storage_of(checkpoint_dir).latest_target(checkpoint_dir)
    if target is None:
        return None
    if os.path.isabs(target) or pathlib.PurePath(target).name != target:
        return f"it points outside this checkpoint directory ({target})"
    step = step_of(target)
    if step is None:
        loops = target == LATEST or (checkpoint_dir / target).is_symlink()
        return f"it points at {target}, {'a loop of links' if loops else 'not a step_<N> folder'}"
    if not step_dir(checkpoint_dir, step).exists():
        return f"it points at {target}, which does not exist"
    if not is_complete(step_dir(checkpoint_dir, step)):
        return f"it points at {target}, which is incomplete"
    return None


def not_a_folder(checkpoint_dir: CheckpointPath, steps: Sequence[int]) -> CheckpointPath | None:
    """The first ``step_<N>`` entry that is a file (or anything else) on a disk, not a folder:
    no checkpoint, and in the way of the save of step N."""
    if not isinstance(checkpoint_dir, pathlib.Path):
        return None  # in an object store a step is a prefix: a file beside it is in no way
    for step in steps:
        path = step_dir(checkpoint_dir, step)
        if path.exists() and not path.is_dir():
            assert isinstance(path, pathlib.Path)
            return path
    return None


def latest_in_the_way(checkpoint_dir: CheckpointPath) -> CheckpointPath | None:
    """``latest`` when it is a folder on a disk: every commit renames a new link onto it,
    which a folder refuses (an object store's ``latest`` is an object, written over)."""
    if not isinstance(checkpoint_dir, pathlib.Path):
        return None
    latest = checkpoint_dir / LATEST
    return latest if latest.is_dir() and not latest.is_symlink() else None


def older_latest_note(checkpoint_dir: CheckpointPath, found: CheckpointPath) -> str | None:
    """The line for a ``latest`` that names a complete checkpoint older than ``found``."""
    latest = latest_step(checkpoint_dir)
    found_step = step_of(found.name)
    if latest is None or found_step is None or latest >= found_step:
        return None
    return (
        f"{checkpoint_dir / LATEST} names step_{latest}, but {found.name} is newer and "
        f"complete: resuming from {found.name} (forge resumes from the newest committed "
        f"checkpoint; to go back to step_{latest} on purpose, move the newer step folders out "
        "of the checkpoint directory and pass --checkpoint.allow_rewind=true)"
    )


def resolve_resume(checkpoint_dir: CheckpointPath, load_path: CheckpointPath | None) -> ResumePlan:
    """Where a run starts from (see the module docstring for the precedence)."""
    candidates = list_steps(checkpoint_dir)
    blocked = not_a_folder(checkpoint_dir, candidates)
    if blocked is not None:
        raise CheckpointError(
            f"{blocked}: not a checkpoint folder, and in the way of this run's save of "
            f"{blocked.name}; move it out of "
            f"{checkpoint_dir}, then run again"
        )
    latest_folder = latest_in_the_way(checkpoint_dir)
    if latest_folder is not None:
        raise CheckpointError(
            f"{latest_folder}: a folder where each commit of this run writes its link to the "
            f"newest checkpoint, and in the way of its first save; move it out of "
            f"{checkpoint_dir}, then run again"
        )
    found = newest_complete(checkpoint_dir)
    latest = latest_step(checkpoint_dir)
    newest_step = max([*candidates, *([latest] if latest is not None else [])], default=None)
    if found is not None:
        found_step = int(found.name.removeprefix("step_"))
        skipped = tuple(
            step_dir(checkpoint_dir, s)
            for s in candidates
            if s > found_step and not is_complete(step_dir(checkpoint_dir, s))
        )
        fallbacks = tuple(
            step_dir(checkpoint_dir, s)
            for s in reversed(candidates)
            if s != found_step and is_complete(step_dir(checkpoint_dir, s))
        )
        problem = latest_problem(checkpoint_dir)
        note = older_latest_note(checkpoint_dir, found) if problem is None else (
            f"{checkpoint_dir / LATEST}: {problem}; resuming from {found.name}, the newest "
            "complete checkpoint, instead"
        )  # fmt: skip
        return ResumePlan(ResumeSource.CHECKPOINT_DIR, found, skipped, fallbacks, note)
    skipped = tuple(step_dir(checkpoint_dir, s) for s in candidates)
    if load_path is not None:
        target = newest_complete(load_path) if not is_complete(load_path) else load_path
        if target is None:
            raise CheckpointError(
                f"checkpoint.load_path={load_path}: no complete checkpoint there; "
                "point it at a step_<N> folder or a checkpoint directory"
            )
        return ResumePlan(ResumeSource.LOAD_PATH, target, skipped)
    if newest_step is not None and skipped:
        raise CheckpointError(
            f"{checkpoint_dir}: holds checkpoints but none is complete "
            f"({', '.join(p.name for p in skipped)}); delete them to start fresh"
        )
    return ResumePlan(ResumeSource.FRESH)


T = TypeVar("T")


class RemovedWhileReadError(CheckpointError):
    """Every checkpoint a reader chose was removed while it read them (a training run's
    retention), none damaged."""


def first_loadable(
    paths: Sequence[CheckpointPath],
    load: Callable[[CheckpointPath], T],
    report: Callable[[str], None] = lambda line: None,
) -> tuple[CheckpointPath, T]:
    """``load`` the first of ``paths`` (newest first) that loads; a damaged one (truncated
    shards or RNG files, unreadable metadata, a train state of the wrong shape) is reported
    and skipped, and one that is no longer committed (removed by retention while it was
    read) is said to be so. An unsafe file, or one written for another model, is never
    skipped: an older checkpoint of the same run would not fare better."""
    errors, removed = [], []
    for path in paths:
        try:
            return path, load(path)
        except (UnsafeCheckpointError, ShapeMismatchError):
            raise
        except CheckpointError as exc:
            if not is_complete(path):
                removed.append(path)
                report(f"{path} was removed while it was read (retention of a newer one)")
                continue
            errors.append(str(exc))
            report(f"skipping unloadable checkpoint {path}: {exc}")
    if removed and not errors:
        raise RemovedWhileReadError(
            f"{paths[0].parent}: every checkpoint chosen was removed while it was read "
            f"({', '.join(p.name for p in removed)}); the run's retention is faster than this "
            "reader: run it again, or raise checkpoint.keep_last_n"
        )
    raise CheckpointError(
        f"{paths[0].parent}: no checkpoint there loads ({'; '.join(errors)}); "
        "delete the broken ones or point checkpoint.dir elsewhere"
    )


READ_ROUNDS = 3  # a reader racing a run's retention resolves the newest again this many times


def load_newest_weights(
    checkpoint_dir: CheckpointPath,
    load_path: CheckpointPath | None,
    model: nn.Module,
    report: Callable[[str], None] = lambda line: None,
    optimizer: torch.optim.Optimizer | None = None,
) -> CheckpointPath:
    """Load the weights a run would resume from into ``model`` (and ``optimizer``, whose state
    some optimizers need for their evaluation weights), with the same resolver and the same
    fallback past damaged checkpoints as training; returns the checkpoint used. A training
    run's retention may remove the step chosen while it is read (a newer one committed
    meanwhile): the newest is resolved again, up to ``READ_ROUNDS`` times."""

    def load(path: CheckpointPath) -> None:
        load_checkpoint(path, model, optimizer, restore_rng_state=False)

    for attempt in range(READ_ROUNDS):
        plan = resolve_resume(checkpoint_dir, load_path)
        if plan.source is ResumeSource.FRESH or plan.path is None:
            raise CheckpointError(f"{checkpoint_dir}: no checkpoint there; train the run first")
        if plan.latest_note is not None and attempt == 0:
            report(f"warning: {plan.latest_note}")
        try:
            path, _ = first_loadable((plan.path, *plan.fallbacks), load, report)
        except RemovedWhileReadError:
            if attempt + 1 == READ_ROUNDS:
                raise
            continue  # a newer checkpoint was committed meanwhile: the newest again
        return path
    raise AssertionError("unreachable")
