"""Stopping torch's checkpoint process (``forge.checkpoint.async_staging.
stop_checkpoint_process``): asked to end and given its grace to finish a write, then
terminated; a save given up on (``grace_s=0``) does not wait for the write."""

from __future__ import annotations

import multiprocessing
import signal
import time
from multiprocessing.connection import Connection

import pytest
from torch.distributed.checkpoint import _async_process_executor

from forge.checkpoint.async_staging import stop_checkpoint_process


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
