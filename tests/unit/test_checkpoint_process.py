"""Stopping torch's checkpoint process (``forge.checkpoint.async_staging.
stop_checkpoint_process``): asked to end and given its grace to finish a write, then
terminated; a save given up on (``grace_s=0``) does not wait for the write."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

import pytest
from torch.distributed.checkpoint import _async_process_executor

from forge.checkpoint.async_staging import quiet_when_orphaned, stop_checkpoint_process


def serve(conn: Connection, obeys: bool) -> None:
    """torch's loop as far as stopping it goes: idle, it ends when asked; inside a write
    that does not return (a store that stopped answering) it reads nothing."""
    if obeys:
        conn.recv()
        return
    time.sleep(600)


class Daemon:
    """torch's checkpoint process as ``stop_checkpoint_process`` sees it: the process and
    the pipe it is told to end through."""

    def __init__(self, obeys: bool) -> None:
        context = multiprocessing.get_context("fork")
        self.pipe, child = context.Pipe()
        self._save_process = context.Process(target=serve, args=(child, obeys), daemon=True)
        self._save_process.start()

    def _send(self, data: object) -> None:
        self.pipe.send(data)


# (case, whether it ends when asked, its grace, how it ended)
STOPS = [
    ("idle: ends when asked, within its grace", True, 30.0, 0),
    ("inside a write, given up on: terminated without a wait", False, 0.0, -signal.SIGTERM),
    ("inside a write past its grace: terminated", False, 0.2, -signal.SIGTERM),
]


@pytest.mark.parametrize(
    "obeys,grace_s,exitcode", [s[1:] for s in STOPS], ids=[s[0] for s in STOPS]
)
def test_the_checkpoint_process_is_stopped_within_its_grace(monkeypatch, obeys, grace_s, exitcode):
    daemon = Daemon(obeys)
    monkeypatch.setattr(_async_process_executor, "_CHECKPOINT_PROCESS", daemon)
    stop_checkpoint_process(grace_s=grace_s)
    assert _async_process_executor._CHECKPOINT_PROCESS is None
    assert not daemon._save_process.is_alive()
    assert daemon._save_process.exitcode == exitcode


def daemon(pipe: Connection, rank_end: Connection, rank: int, out: str) -> None:
    """The checkpoint process: its rank's requests read from ``pipe`` until it breaks; what
    ``quiet_when_orphaned`` did goes to ``out`` (its stderr too)."""
    rank_end.close()  # only the rank holds the other end: its exit breaks the pipe
    with open(out, "w") as f:
        sys.stderr = f
        try:
            quiet_when_orphaned(lambda: pipe.recv() and None, rank)
            f.write("returned\n")
        except EOFError:
            f.write("raised\n")


def rank(out: str, dies: bool) -> None:
    """A rank that starts its checkpoint process, then dies (``dies``) or closes its end of
    the pipe and lives on."""
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    context.Process(target=daemon, args=(theirs, mine, os.getpid(), out)).start()
    theirs.close()
    if dies:
        os._exit(0)  # its children are not waited for: the daemon is orphaned
    mine.close()
    time.sleep(3)  # alive while the daemon finds its pipe broken


# (case, whether the rank dies, what the checkpoint process did)
ORPHANS = [
    ("its rank died: one line, no traceback", True, "its rank process"),
    ("its rank lives: the error is raised", False, "raised"),
]


@pytest.mark.parametrize("dies,said", [o[1:] for o in ORPHANS], ids=[o[0] for o in ORPHANS])
def test_a_checkpoint_process_whose_rank_died_ends_in_one_line(tmp_path, dies, said):
    out = tmp_path / "daemon.log"
    context = multiprocessing.get_context("fork")
    context.Process(target=rank, args=(str(out), dies)).start()
    deadline = time.monotonic() + 30
    while not out.is_file() or not out.read_text().endswith(("returned\n", "raised\n")):
        assert time.monotonic() < deadline, out.read_text() if out.is_file() else "no log"
        time.sleep(0.05)
    log = out.read_text()
    assert said in log and "Traceback" not in log
    assert log.endswith("returned\n" if dies else "raised\n")
