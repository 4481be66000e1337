"""A script's ``main`` run in the test's own process, its output and exit code captured as
``subprocess.run`` would give them: for the tests where a process of its own proves nothing
(a refusal, a report, ``--help``) and its start-up (importing torch and forge: about 4 s on
this machine) would be most of the test."""

from __future__ import annotations

import contextlib
import io
import subprocess
from collections.abc import Callable, Sequence


def run_main(main: Callable[[list[str]], int], args: Sequence[str]) -> subprocess.CompletedProcess:
    """``main(args)`` with stdout and stderr captured; argparse's ``SystemExit`` (``--help``,
    a bad option) is its exit code. An exception ``main`` lets through fails the test, as a
    traceback would."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
