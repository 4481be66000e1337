"""Where each rank was when a run hung: every thread's Python stack, in
``<run.dir>/stacks/rank<R>.txt``.

Two writers fill a rank's file. A watchdog (``faulthandler.dump_traceback_later``: a C thread
that needs no GIL), re-armed after every step, dumps every thread's stack when the rank makes
no progress for ``distributed.timeout_s``: a rank waiting in a collective, asleep, in I/O, or
in C code that holds the GIL. And when a collective of a step fails or times out
(``forge.resilience.health``), or the run ends HEALTH_FAILURE, the rank appends one line (the
collective in flight, the failed health check, or the exception that ended it) and its stacks
at that moment. An attempt appends to what earlier attempts of the run left (a restart or a
resume keeps their evidence); one that ends any other way takes back what it wrote, since a
slow but healthy stretch may have tripped the watchdog; and until a failure is recorded only
the watchdog's latest dump is kept, so a run of slow steps does not grow the file.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pathlib
import sys
from collections.abc import Iterator

from forge.types import Hooks, LoopOutcome, LoopState, StepResult


def native_crash_stacks() -> bool:
    """Where faulthandler is on (``PYTHONFAULTHANDLER=1``, ``python -X faulthandler``): torch's
    native stacks too when a fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGABRT) ends the
    process, every thread's C++ frames before faulthandler's Python ones; whether they are
    on. Only where asked: torch's handler formats them with calls that are not
    async-signal-safe, so a crash inside the allocator could hang there instead of ending
    the rank. (A process-wide setting: for a script's own process, not a notebook's.)"""
    import torch  # only when called: importing this module stays light

    enable = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if not faulthandler.is_enabled() or enable is None:  # (a torch without it: Python's)
        return False
    enable(True)
    return True


def stacks_path(run_dir: pathlib.Path, rank: int | str) -> pathlib.Path:
    """Where rank ``rank`` writes its stacks (``"<R>"``: every rank's, as messages name
    them)."""
    return run_dir / "stacks" / f"rank{rank}.txt"


def every_rank(run_dir: pathlib.Path) -> pathlib.Path:
    """Every rank's stacks file, as a message names them: ``<run.dir>/stacks/rank<R>.txt``."""
    return stacks_path(run_dir, "<R>")


class StackWatch(Hooks):
    """A rank's stacks file and its watchdog: armed when training begins, re-armed at the end
    of every step (place it before hooks that may stall: it re-arms first)."""

    def __init__(self, path: pathlib.Path, timeout_s: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.timeout_s = timeout_s
        # held open for the run: the watchdog writes to its descriptor from a C thread
        self.file = open(path, "a")  # noqa: SIM115
        self.start = os.fstat(self.file.fileno()).st_size  # earlier attempts' evidence
        self.recorded = False

    def forget_dumps(self) -> None:
        """Take back what this attempt wrote (the watchdog's dumps, nothing recorded)."""
        if os.fstat(self.file.fileno()).st_size > self.start:
            self.file.truncate(self.start)

    def arm(self) -> None:
        if not self.recorded:
            self.forget_dumps()  # progress was made: an earlier dump was a slow stretch
        faulthandler.dump_traceback_later(self.timeout_s, repeat=False, file=self.file)

    def on_train_begin(self, state: LoopState) -> None:
        self.arm()

    def on_step_end(self, state: LoopState, result: StepResult) -> None:
        self.arm()

    def on_train_end(self, outcome: LoopOutcome, state: LoopState) -> None:
        if outcome is LoopOutcome.HEALTH_FAILURE and not self.recorded:  # the health check
            self.record(f"the health check failed after step {state.step}")

    def record(self, line: str) -> None:
        """Append ``line`` and every thread's stack as it is now."""
        self.file.write(f"{line}\n")
        self.file.flush()
        faulthandler.dump_traceback(self.file, all_threads=True)
        self.file.flush()
        self.recorded = True

    def close(self) -> None:
        """Disarm; keep the file only when a failure was recorded (the watchdog's dumps alone
        may come from a slow but healthy stretch)."""
        faulthandler.cancel_dump_traceback_later()
        if not self.recorded:
            self.forget_dumps()
        self.file.close()
        if not self.recorded and self.start == 0:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # other ranks' files are still there
                self.path.parent.rmdir()


@contextlib.contextmanager
def stack_watch(run_dir: pathlib.Path, rank: int, world_size: int, timeout_s: float
                ) -> Iterator[StackWatch | None]:  # fmt: skip
    """A ``StackWatch`` for this rank while training runs, closed however it ends; None in a
    single process (no collective to hang in)."""
    if world_size == 1:
        yield None
        return
    path = stacks_path(run_dir, rank)
    try:
        watch = StackWatch(path, timeout_s)
    except OSError as exc:  # a diagnostic only: never the reason a run fails
        print(f"[forge] warning: rank {rank}: no stacks file {path} ({exc})", file=sys.stderr)
        yield None
        return
    try:
        yield watch
    except Exception as exc:
        watch.record(f"rank {rank}: the run ended with {type(exc).__name__}: {exc}")
        raise
    finally:
        watch.close()
