"""Every script answers ``--help``: exit 0, its usage on stdout, no traceback (the first
command a new user runs)."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.zygote import run_script

SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py"))


def test_there_are_scripts_to_ask():
    assert len(SCRIPTS) >= 8


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_script_answers_help(script):
    out = run_script([str(script), "--help"], timeout=120)  # forked: tests/zygote.py
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr[-2000:]
    assert "usage" in stdout.lower() and "Traceback" not in stderr
