"""Preemption signals become a flag that the loop polls at step boundaries; during set-up
they stop set-up where it is (``SetupInterrupted``): no step ran, so there is nothing to save.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import FrameType
from typing import NoReturn

from forge.errors import UserInputError
from forge.types import ExitCode

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# how long set-up may take to stop after a signal (its clean-up: the run directory's lock
# released, a claim taken back) before the process ends all the same
SETUP_GRACE_S = 5.0
PAUSE_ENV = "FORGE_SETUP_PAUSE"  # test-only: the set-up point where set-up waits
PAUSE_S = 120.0


def setup_exit_code(signum: int) -> ExitCode:
    """The exit code of a run stopped during set-up: 130 for Ctrl-C (SIGINT: a person
    stopped it), else 75 (a scheduler's SIGTERM or SIGUSR1: requeue, try again later)."""
    return ExitCode.INTERRUPTED if signum == signal.SIGINT else ExitCode.SHUTDOWN


def setup_stop_line(signum: int) -> str:
    """The one line of a run stopped during set-up."""
    name = signal.Signals(signum).name
    return f"interrupted ({name}) during set-up: stopped before training; nothing was written"


def hold_shutdown_signals() -> AbstractSet[int]:
    """The train script's first statement: the shutdown signals blocked in its main thread
    (its threads inherit the mask) while it imports torch (1-2 s) and checks its config, so
    that one arriving meanwhile waits, pending, for ``release_shutdown_signals``; returns the
    mask before. Raised inside an import, the signal would end the process in a traceback
    (SIGINT), or SIGTERM's default in no word at all; and a launcher's SIGTERM to a rank
    whose peer refused the config would turn that refusal into a retryable 75 here."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, SHUTDOWN_SIGNALS)


def release_shutdown_signals(before: AbstractSet[int], problems: Sequence[str]) -> None:
    """Set the mask back to ``before`` once the config's own checks found ``problems``: a
    signal held since the start is then handled (set-up stops: 75, or 130 for Ctrl-C) —
    unless the config is bad, which every rank finds alike: that ends the process first
    (``UserInputError``, exit 2), whoever sent the signal. Nothing held, nothing to do."""
    if problems and set(signal.sigpending()) & set(SHUTDOWN_SIGNALS):
        raise UserInputError(list(problems))
    signal.pthread_sigmask(signal.SIG_SETMASK, before)


class SetupInterrupted(BaseException):
    """A shutdown signal during set-up, raised on the main thread by the handler: set-up stops
    where it is and unwinds (the run directory released and discarded). A ``BaseException``,
    as ``KeyboardInterrupt``: no ``except Exception`` of set-up (a store's probe) takes it
    for a failure of its own."""

    def __init__(self, signum: int) -> None:
        super().__init__(setup_stop_line(signum))
        self.signum = signum
        self.exit_code = setup_exit_code(signum)


def pause_if_asked(env: Mapping[str, str], point: str) -> None:
    """Test-only (``FORGE_SETUP_PAUSE=<point>``; never in production): set-up says that it
    waits at ``point`` and waits there, as a slow phase would, for a test to signal it."""
    if env.get(PAUSE_ENV) == point:
        print(f"[forge] test: set-up waits at {point}", file=sys.stderr, flush=True)
        time.sleep(PAUSE_S)


class SetupWatch:
    """A thread that sees each shutdown signal through ``signal.set_wakeup_fd`` and ends the
    process ``grace_s`` later unless set-up stopped by then (``stop``). The handler runs on the
    main thread only once it runs Python again: a call blocked in C that never returns (a
    rendezvous waiting for a peer that is not coming) would hold the signal hostage. Created
    and stopped on the main thread."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd's demand: a signal never blocks
        self._over = threading.Event()
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="forge-setup-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        shutdown = {int(s) for s in SHUTDOWN_SIGNALS}
        try:
            while not self._over.is_set():
                seen = [n for n in os.read(self._read, 64) if n in shutdown]
                if seen and not self._over.wait(self.grace_s):
                    name = signal.Signals(seen[0]).name
                    print(
                        f"[forge] interrupted ({name}) during set-up: a call that does not "
                        f"return to Python held the signal for {self.grace_s:g} s; exiting",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(setup_exit_code(seen[0]))
        except OSError:  # the pipe closed under it: set-up is over
            return

    def stop(self) -> None:
        self._over.set()
        signal.set_wakeup_fd(self._previous)
        os.write(self._write, b"\0")  # wakes the thread's read (0 is no signal)
        self._thread.join(timeout=1.0)
        os.close(self._read)
        os.close(self._write)


class ShutdownFlag:
    """Installs handlers for SIGTERM, SIGUSR1 and SIGINT; the loop reads ``requested()``.

    A second SIGINT (Ctrl-C pressed twice) abandons whatever is in progress, the emergency
    save included, and exits with ``interrupt_exit_code`` at once, without a traceback: saves
    are written under a temporary name, so ``latest`` still names a complete checkpoint. With
    ``timeout_s`` set, the process exits with ``exit_code`` that many seconds after the first
    signal if it is still running (a stuck emergency save must not outlive the scheduler's
    grace period).

    While ``setting_up`` (until ``setup_done``), a signal raises ``SetupInterrupted`` on the
    main thread instead, and a ``SetupWatch`` ends the process if set-up has not stopped
    ``SETUP_GRACE_S`` later; a second signal meanwhile ends it at once.
    """

    def __init__(
        self,
        timeout_s: float | None = None,
        exit_code: int = ExitCode.SHUTDOWN,
        interrupt_exit_code: int = ExitCode.INTERRUPTED,
        setting_up: bool = False,
    ) -> None:
        self.received: int | None = None
        self.setting_up = setting_up
        self._watch: SetupWatch | None = None
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self.interrupt_exit_code = interrupt_exit_code
        self._timer: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> ShutdownFlag:
        if self.setting_up:  # first: from the first handler on, the watch sees each signal
            self._watch = SetupWatch(SETUP_GRACE_S)
        for sig in SHUTDOWN_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def reaches(self) -> bool:
        """Whether every shutdown signal is handled by this flag now and not blocked (a guard
        of the start: a launcher or library may have put its own handler in its place, or a
        parent process blocked it: a mask survives exec, and each thread inherits it)."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return all(
            signal.getsignal(sig) == self._handle and sig not in blocked for sig in SHUTDOWN_SIGNALS
        )

    def setup_done(self) -> None:
        """Set-up is over: a signal now asks for a save at the end of a step."""
        self.setting_up = False
        self._stop_watch()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def uninstall(self) -> None:
        self._stop_watch()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.setting_up:
            self._stop_setup(signum)
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

    def _stop_setup(self, signum: int) -> NoReturn:
        if self.received is not None:  # a second signal while set-up stops: at once
            name = signal.Signals(signum).name
            print(f"[forge] second signal ({name}) during set-up: exiting now", file=sys.stderr)
            sys.stderr.flush()
            os._exit(setup_exit_code(self.received))
        self.received = signum
        raise SetupInterrupted(signum)

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
