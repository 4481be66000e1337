"""Every script answers ``--help``: exit 0, its usage on stdout, no traceback (the first
command a new user runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py"))


def test_there_are_scripts_to_ask():
    assert len(SCRIPTS) >= 8


# how Python may be started: plainly, or with docstrings stripped (-OO), which a script's
# description must survive
FLAGS = [[], ["-OO"]]


@pytest.mark.parametrize("flags", FLAGS, ids=["plain", "-OO"])
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_script_answers_help(script, flags):
    # a fresh interpreter (not tests/zygote.py, which has imported what the scripts import):
    # what is checked is that the script starts
    out = subprocess.run([sys.executable, *flags, str(script), "--help"], capture_output=True,
                         timeout=120, check=False, cwd=REPO)  # fmt: skip
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr[-2000:]
    assert "usage" in stdout.lower() and "Traceback" not in stderr
