"""``scripts/train.py`` with the replica comparison made inert (a mutant: no mesh dim counts as
one whose ranks hold replicated values), for the guard check that must then refuse to start."""

from __future__ import annotations

import pathlib
import runpy
import sys

from forge.training.steps import replay

REPO = pathlib.Path(__file__).resolve().parents[2]


def main() -> None:
    replay.REPLICATED_DIMS = ()  # type: ignore[misc]
    sys.argv = [str(REPO / "scripts" / "train.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
