"""A script's ``main`` run in the test's own process, its output and exit code captured as
``subprocess.run`` would give them: for the tests where a process of its own proves nothing
(a refusal, a report, ``--help``) and its start-up (importing torch and forge: about 4 s on
this machine) would be most of the test."""

from __future__ import annotations

import contextlib
import io
import signal
import subprocess
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

# the handlers a script installs (forge.resilience.signals, forge.interrupts)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def as_a_process(err: TextIO) -> Iterator[None]:
    """What a process of its own would keep apart: the signal handlers the script installs
    are put back however it ends, and a traceback in one of its threads goes to its stderr
    (where a test looks for one) instead of pytest's warnings."""
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    hook = threading.excepthook

    def to_stderr(args: threading.ExceptHookArgs) -> None:
        traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback, file=err)

    threading.excepthook = to_stderr
    try:
        yield
    finally:
        threading.excepthook = hook
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_main(
    main: Callable[..., int], args: Sequence[str], **kwargs
) -> subprocess.CompletedProcess:
    """``main(args)`` with stdout and stderr captured; argparse's ``SystemExit`` (``--help``,
    a bad option) is its exit code. An exception ``main`` lets through fails the test, as a
    traceback would."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), as_a_process(err):
        try:
            code = main(list(args), **kwargs)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
