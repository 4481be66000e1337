"""How a script other than ``train.py`` ends at Ctrl-C or SIGTERM: one line, exit 130
(``ExitCode.INTERRUPTED``), nothing half-written.

``train.py`` answers its first signal with an emergency checkpoint (``forge.resilience.signals``).
The other scripts have nothing to save: they stop where they are. Their outputs are written
under a temporary sibling renamed into place (``forge.outputs``), removed on the way out, so an
interrupted script leaves what was there before and nothing else.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import ParamSpec

from forge.types import ExitCode

P = ParamSpec("P")
STOPPING = (signal.SIGINT, signal.SIGTERM)


def interrupt_line(signum: int | None) -> str:
    """The one line an interrupted script prints."""
    name = signal.Signals(signum).name if signum is not None else "SIGINT"
    return f"interrupted ({name}): stopped; nothing it was writing is left behind"


def exits_on_interrupt(main: Callable[P, int]) -> Callable[P, int]:
    """``main`` with SIGINT and SIGTERM ending it in ``interrupt_line`` and exit 130 instead of
    a traceback (SIGTERM's default would end it with no word at all)."""

    @functools.wraps(main)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> int:
        received: list[int] = []

        def stop(signum: int, _frame: FrameType | None) -> None:
            received.append(signum)
            raise KeyboardInterrupt

        in_main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, stop) for s in STOPPING} if in_main else {}
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            print(interrupt_line(received[0] if received else None), file=sys.stderr, flush=True)
            return ExitCode.INTERRUPTED
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    return guarded
