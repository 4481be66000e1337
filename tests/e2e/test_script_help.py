"""Every script under ``scripts/`` answers ``--help`` (argparse's usage, exit 0: the first
command a new user runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py"))


def test_there_are_scripts_to_ask():
    assert len(SCRIPTS) >= 8


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_script_answers_help_in_a_fresh_interpreter_without_importing_torch(script):
    """A fresh interpreter (not tests/zygote.py, which has imported what the scripts import):
    the script starts as a user starts it, under -OO (docstrings stripped, which a script's
    description must survive); its imports listed (-X importtime): --help answers before
    torch's import (``forge.cli.help_first``), which takes seconds."""
    argv = [sys.executable, "-OO", "-X", "importtime", str(script), "--help"]
    out = subprocess.run(argv, capture_output=True, timeout=120, check=False, cwd=REPO)
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr[-2000:]
    assert "usage" in stdout.lower() and "Traceback" not in stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if "|" in line}
    assert "forge.cli" in imported or "argparse" in imported  # the listing is there
    assert "torch" not in imported


def test_a_scripts_help_describes_it_from_its_docstring():
    """Without -OO the description is the docstring's first line (the test above strips it)."""
    script = REPO / "scripts" / "goodput.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         timeout=120, check=False, cwd=REPO)  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    first = script.read_text().split('"""')[1].strip().splitlines()[0]
    assert first in out.stdout.decode()


# (script, the arguments before its run directory) of every script that reads a run
READERS = [
    ("eval", []),
    ("eval_follow", []),
    ("eval_harness", []),
    ("generate", []),
    ("goodput", []),
    ("convert_checkpoint", ["export", "--out", "/nonexistent/out"]),
]


@pytest.mark.parametrize("name,before", READERS, ids=[r[0] for r in READERS])
def test_a_url_given_as_the_run_directory_is_refused_as_typed(name, before):
    """As a ``pathlib.Path``, ``s3://bucket/run`` was ``s3:/bucket/run``: quoted so in the
    refusal, and a follower waited ten minutes for that local folder to appear."""
    from tests.e2e.test_train_script import load_script
    from tests.in_process import run_main

    out = run_main(load_script(name).main, [*before, "s3://bucket/run"])
    assert out.returncode == 2
    assert "'s3://bucket/run' is a URL; give the run directory" in out.stderr
