"""A script other than train.py ends at Ctrl-C or SIGTERM in one line and exit 130."""

from __future__ import annotations

import os
import signal

import pytest

from forge.interrupts import exits_on_interrupt
from forge.types import ExitCode


def ctrl_c() -> int:
    raise KeyboardInterrupt


def sigterm() -> int:
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not stop the script")


def sigint() -> int:
    os.kill(os.getpid(), signal.SIGINT)
    raise AssertionError("SIGINT did not stop the script")


# (case, the script's body, exit code, the line it prints)
CASES = [
    ("it finishes", lambda: 0, 0, None),
    ("it fails as it says", lambda: 2, 2, None),
    ("Ctrl-C", ctrl_c, ExitCode.INTERRUPTED, "interrupted (SIGINT)"),
    ("SIGINT", sigint, ExitCode.INTERRUPTED, "interrupted (SIGINT)"),
    ("SIGTERM", sigterm, ExitCode.INTERRUPTED, "interrupted (SIGTERM)"),
]


@pytest.mark.parametrize(
    ("body", "code", "line"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_script_ends_in_one_line_and_its_exit_code(body, code, line, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert exits_on_interrupt(body)() == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ([] if line is None else [err[0]]) and (line is None or line in err[0])
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are put back
