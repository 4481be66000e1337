"""Sandboxes for the hostile-input tests: a run directory, a config and a private copy of the
data, and ``scripts/train.py`` run as a real process (``train``) or in this one
(``train_here``: a refusal proves nothing more for a process of its own, and skips its 4 s
start-up)."""

from __future__ import annotations

import pathlib
import shutil
import sys

import attrs

from tests.conftest import REPO, TINY
from tests.e2e.test_train_script import TRAIN as TRAIN_SCRIPT
from tests.in_process import run_main
from tests.zygote import run_script

TRAIN = [sys.executable, str(REPO / "scripts" / "train.py")]


@attrs.frozen
class Run:
    """A row's sandbox: its config, its run directory and its own copy of the data."""

    root: pathlib.Path
    config: pathlib.Path
    data: pathlib.Path

    @property
    def dir(self) -> pathlib.Path:
        return self.root / "run"

    @property
    def ckpt(self) -> pathlib.Path:
        return self.dir / "checkpoints"


@attrs.frozen
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def errors(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def train(
    run: Run, *args: str, env: dict[str, str] | None = None, file_size_limit: int | None = None
) -> Result:
    """``scripts/train.py`` on the sandbox's config; ``file_size_limit``: the process may
    write no file larger than that many bytes (``ulimit -f``)."""

    out = run_script([*TRAIN[1:], str(run.config), *args], env=env, file_size_limit=file_size_limit)
    return Result(out.returncode, out.stdout.decode(), out.stderr.decode())


def train_here(run: Run, *args: str) -> Result:
    """``scripts/train.py``'s ``main`` on the sandbox's config in this process, its output
    captured (an exception it lets through fails the test, as a traceback would)."""
    done = run_main(TRAIN_SCRIPT.main, [str(run.config), *args])
    return Result(done.returncode, done.stdout, done.stderr)


def make_run(root: pathlib.Path, data: pathlib.Path) -> Run:
    config = root / "tiny.toml"
    # rows resume the run trained to step 10 up to max_steps 12: the config's schedule applies
    text = TINY.format(data=data).replace(
        "[checkpoint]\n", '[checkpoint]\nschedule_from = "config"\n'
    )
    config.write_text(text + f'\n[run]\ndir = "{root / "run"}"\n')
    return Run(root, config, data)


def copy_trained(trained: Run, sandbox: Run) -> None:
    shutil.copytree(trained.dir, sandbox.dir, symlinks=True)
