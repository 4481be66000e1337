"""Preemption signals become a flag that the loop polls at step boundaries."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

from forge.types import ExitCode

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class ShutdownFlag:
    """Installs handlers for SIGTERM, SIGUSR1 and SIGINT; the loop reads ``requested()``.

    A second SIGINT (Ctrl-C pressed twice) abandons whatever is in progress, the emergency
    save included, and exits with ``interrupt_exit_code`` at once, without a traceback: saves
    are written under a temporary name, so ``latest`` still names a complete checkpoint. With
    ``timeout_s`` set, the process exits with ``exit_code`` that many seconds after the first
    signal if it is still running (a stuck emergency save must not outlive the scheduler's
    grace period).
    """

    def __init__(
        self,
        timeout_s: float | None = None,
        exit_code: int = ExitCode.SHUTDOWN,
        interrupt_exit_code: int = ExitCode.INTERRUPTED,
    ) -> None:
        self.received: int | None = None
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self.interrupt_exit_code = interrupt_exit_code
        self._timer: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> ShutdownFlag:
        for sig in SHUTDOWN_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def reaches(self) -> bool:
        """Whether every shutdown signal is handled by this flag now (a guard of the start:
        a launcher or library may have put its own handler in its place)."""
        return all(signal.getsignal(sig) == self._handle for sig in SHUTDOWN_SIGNALS)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            self._abandon()
        self.received = signum
        if signum == signal.SIGINT:
            print(
                "[forge] interrupted: saving a checkpoint at the end of this step; press "
                "Ctrl-C again to abandon it",
                file=sys.stderr,
                flush=True,
            )
        if self.timeout_s is not None and self._timer is None:
            self._timer = threading.Timer(self.timeout_s, self._force_exit)
            self._timer.daemon = True
            self._timer.start()

    def _abandon(self) -> None:
        sys.stdout.flush()
        print(
            "[forge] second interrupt: abandoning the save in progress; 'latest' still names "
            "the last complete checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(self.interrupt_exit_code)

    def _force_exit(self) -> None:
        print(
            f"[forge] shutdown did not finish within {self.timeout_s} s; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(self.exit_code)

    def requested(self) -> bool:
        return self.received is not None
