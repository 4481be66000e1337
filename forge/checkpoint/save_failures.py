"""What a failed save says: its cause in one line (a lack of space named as one), and what it
leaves of the run's checkpoints, checked through the storage, never assumed."""

from __future__ import annotations

import pathlib
import shutil

from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.storage import Storage, step_dir
from forge.errors import no_space, one_line, out_of_space, short_write


class PeerLostError(RuntimeError):
    """A collective of a save failed: a peer stalled or died while the ranks were saving.
    Nothing of the save can be agreed or committed (this rank cannot know what its peers
    wrote); the run ends HEALTH_FAILURE, not SAVE_FAILED: the storage is not at fault."""

    def __init__(self, step: int, message: str) -> None:
        self.step, self.message = step, message
        super().__init__(f"saving step {step}: a collective of the save failed ({message})")


# below this much free space, a write torch reports as short (no OSError to say why) is
# taken for a full disk: a write that found no room leaves the disk all but full
NEARLY_FULL_BYTES = 64 << 20


def failure_cause(exc: BaseException, place: CheckpointPath) -> str:
    """A failed write in one line, named a lack of space where it is one: an ``OSError`` that
    says so, or torch's short write on a disk left (all but) full at ``place``."""
    cause = one_line(exc)
    if out_of_space(exc) or (short_write(exc) and nearly_full(place)):
        return no_space(cause)
    return cause


def nearly_full(place: CheckpointPath) -> bool:
    """Whether the local disk that holds ``place`` has less than ``NEARLY_FULL_BYTES`` free
    (False for an object store, and where the disk cannot be asked)."""
    if not isinstance(place, pathlib.Path):
        return False
    for folder in (place, *place.parents):  # the nearest that exists
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free < NEARLY_FULL_BYTES
            except OSError:
                return False
    return False


def newest_committed(storage: Storage, root: CheckpointPath, steps: list[int]) -> int:
    """The newest of ``steps`` (``root``'s, ascending) that is a complete checkpoint; -1:
    none is."""
    return next((s for s in reversed(steps) if storage.is_complete(step_dir(root, s))), -1)


def what_remains(storage: Storage, root: CheckpointPath, previous: int | None) -> str:
    """What a failed save leaves of the run's checkpoints, checked through the storage now:
    the newest committed step before it (``previous``; -1: none; None: not listed yet, so
    the newest complete one now) and ``latest``, intact or which of them is gone."""
    try:
        if previous is None:
            previous = newest_committed(storage, root, storage.list_steps(root))
        if previous < 0:
            return "no earlier checkpoint of this run was committed"
        name = f"step_{previous}"
        there = storage.is_complete(step_dir(root, previous))
        latest = storage.latest_target(root)
    except OSError as exc:
        cause = one_line(exc)
        return f"whether the previous checkpoint and 'latest' are intact is unknown ({cause})"
    if there and latest == name:
        return f"the previous checkpoint ({name}) and 'latest' are intact"
    gone = [f"the previous checkpoint {name}"] if not there else []
    gone += ["'latest'"] if latest is None else []
    found = []
    if gone:
        are = "are" if len(gone) > 1 else "is"
        found.append(f"{' and '.join(gone)} {are} gone (deleted, or lost by the store)")
    if latest is not None and latest != name:
        found.append(f"'latest' names {latest}, not {name}")
    return "; ".join(found)
