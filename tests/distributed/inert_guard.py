"""``scripts/train.py`` with one guard's mechanism made inert (a mutant named by the first
argument), for the guard check that must then refuse to start:

- ``replicas``: no mesh dim counts as one whose ranks hold replicated values;
- ``health``: the control word gets no group of its own;
- ``stragglers``: the step is not timed (no own time reported);
- ``stacks``: the hang watchdog is never armed.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

from forge.resilience import control, stacks, stragglers
from forge.training.steps import replay

REPO = pathlib.Path(__file__).resolve().parents[2]


def no_group(self, world_size: int, timeout_s: float) -> None:
    self.group, self.failed = None, False


MUTANTS = {
    "replicas": lambda: setattr(replay, "REPLICATED_DIMS", ()),
    "health": lambda: setattr(control.ControlChannel, "__init__", no_group),
    "stragglers": lambda: setattr(stragglers, "timed", lambda step, *args: step),
    "stacks": lambda: setattr(stacks.StackWatch, "arm", lambda self: None),
}


def main() -> None:
    MUTANTS[sys.argv[1]]()
    sys.argv = [str(REPO / "scripts" / "train.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
