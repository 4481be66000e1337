"""Preemption signals become a flag that the loop polls at step boundaries."""

from __future__ import annotations

import signal
from types import FrameType

from forge.training.state import Signals

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class ShutdownFlag:
    """Installs handlers for SIGTERM, SIGUSR1 and SIGINT; ``poll()`` reports them as ``Signals``.

    A second SIGINT restores the default handler's behaviour (KeyboardInterrupt) at once.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> ShutdownFlag:
        for sig in SHUTDOWN_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def poll(self) -> Signals:
        return Signals(shutdown_requested=self.received is not None)
