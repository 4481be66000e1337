"""Pure checkpoint decisions: when to save, what to delete. No torch, no file system."""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs


@attrs.frozen
class SaveSchedule:
    """Every ``interval`` steps, plus power-of-two milestones inside an optional window.

    Inside ``[window_start, window_stop]`` only milestones save (start, start+1, start+2,
    start+4, ...); outside it, multiples of ``interval``.
    """

    interval: int
    window_start: int | None = None
    window_stop: int | None = None

    def is_milestone(self, step: int) -> bool:
        """True for the window's power-of-two offsets (and its start, step 0 included)."""
        if self.window_start is None or self.window_stop is None:
            return False
        if not self.window_start <= step <= self.window_stop:
            return False
        offset = step - self.window_start
        return offset == 0 or offset & (offset - 1) == 0

    def in_window(self, step: int) -> bool:
        return (
            self.window_start is not None
            and self.window_stop is not None
            and self.window_start <= step <= self.window_stop
        )

    def should_save(self, step: int) -> bool:
        """Whether the checkpoint gate fires after reaching ``step``."""
        if self.in_window(step):
            return self.is_milestone(step)
        return step > 0 and step % self.interval == 0


_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_of(dirname: str) -> int | None:
    """The step of a ``step_<N>`` directory name, else None (temporary and other names)."""
    m = _STEP_DIR.match(dirname)
    return int(m.group(1)) if m else None


def retention_plan(
    steps: Iterable[int],
    keep_last_n: int,
    latest: int | None,
    schedule: SaveSchedule,
    in_flight: int | None = None,
    incomplete: Iterable[int] = (),
) -> list[int]:
    """Steps to delete: of the complete ``steps``, all but the newest ``keep_last_n``, never
    ``latest``, a milestone or the in-flight save; of the ``incomplete`` ones (damaged: a save
    is complete before it is renamed), those older than the newest complete step. Only complete
    checkpoints count towards ``keep_last_n``, so a damaged one never displaces a good one.
    ``keep_last_n <= 0`` keeps everything."""
    if keep_last_n <= 0:
        return []
    ordered = sorted(set(steps), reverse=True)
    protected = {latest, in_flight}
    doomed = {
        s for s in ordered[keep_last_n:] if s not in protected and not schedule.is_milestone(s)
    }
    if ordered:
        doomed |= {s for s in incomplete if s < ordered[0] and s not in protected}
    return sorted(doomed)
