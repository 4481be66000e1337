"""Every script under ``scripts/`` answers ``--help`` (argparse's usage, exit 0: the first
command a new user runs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py"))


def test_there_are_scripts_to_ask():
    assert len(SCRIPTS) >= 8


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_script_answers_help(script):
    # a fresh interpreter (not tests/zygote.py, which has imported what the scripts import):
    # what is checked is that the script starts
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         timeout=120, check=False, cwd=REPO)  # fmt: skip
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr[-2000:]
    assert "usage" in stdout.lower() and "Traceback" not in stderr


# each script's --help run in one interpreter started with -OO (docstrings stripped, which a
# script's description must survive): the imports are paid once (twelve fresh interpreters
# cost about 40 s of CPU), the scripts' own starts are the test above's
UNDER_OO = """
import contextlib, io, json, os, runpy, sys, traceback

def leave(code):  # a script that ends with os._exit (train.py: no slow teardown) ends here
    raise SystemExit(code)

os._exit = leave
answers = {}
for path in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        code, out = 1, io.StringIO(traceback.format_exc())
    answers[path] = [code, out.getvalue()]
print(json.dumps(answers))
"""


def test_every_script_answers_help_with_docstrings_stripped():
    paths = [str(p) for p in SCRIPTS]
    out = subprocess.run([sys.executable, "-OO", "-c", UNDER_OO, *paths], capture_output=True,
                         timeout=240, check=False, cwd=REPO)  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    answers = json.loads(out.stdout.decode().splitlines()[-1])
    assert sorted(answers) == paths
    for path, (code, text) in answers.items():
        assert code == 0 and "usage" in text.lower(), (path, text[-2000:])
