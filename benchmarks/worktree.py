"""A base commit checked out beside the working tree, for the benchmarks that measure
forge against an earlier forge in the same run (``--base``)."""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

REPO = pathlib.Path(__file__).resolve().parents[1]


def base_worktree(base: str, folder: pathlib.Path) -> pathlib.Path:
    """A detached git worktree of ``base`` in ``folder`` (removed by ``drop_worktree``)."""
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(folder), base],
        check=True,
    )
    return folder


def drop_worktree(folder: pathlib.Path) -> None:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(folder)], check=False
    )


@contextlib.contextmanager
def checked_out(base: str) -> Iterator[pathlib.Path | None]:
    """``base`` in a temporary worktree, removed afterwards; None (after one line saying so)
    when this clone lacks the commit."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            folder = base_worktree(base, pathlib.Path(tmp) / "base")
        except subprocess.CalledProcessError:
            print(f"--base {base}: no such commit here (a shallow clone?); fetch it first")
            yield None
            return
        try:
            yield folder
        finally:
            drop_worktree(folder)


# A fresh interpreter running a benchmark script (argv[2:]) with the forge of the checkout at
# argv[1]: the editable install's finder set aside, so that the checkout's own forge loads.
RUN_WITH = """
import os, runpy, sys
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in repr(f)]
sys.path.insert(0, sys.argv[1])
import forge
assert forge.__file__.startswith(sys.argv[1]), forge.__file__
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def python_with_forge_of(root: pathlib.Path) -> list[str]:
    """The command that runs a script (the arguments after it) with ``root``'s forge."""
    return [sys.executable, "-c", RUN_WITH, str(root)]
