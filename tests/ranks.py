"""Real ranks without torchrun's agent: one process per rank, started with the variables
torchrun gives its workers (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), their output
interleaved in one stdout and one stderr as under torchrun.

The agent is a process of its own that imports torch and holds a rendezvous: about 2 s of
every launch on this machine's 2 cores, and it proves nothing a test of forge's ranks asks.
The tests of torchrun itself (restarts, its shared store, a rank signalled under it) still
start torchrun.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

POLL_S = 0.05
GRACE_S = 10.0  # after a rank fails, how long the others may take to fail alike


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(env: Mapping[str, str], rank: int, ranks: int, port: int) -> dict[str, str]:
    """What torchrun sets for worker ``rank`` of ``ranks`` on one node."""
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_ranks(
    ranks: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """``python argv...`` as ``ranks`` ranks; the first failing rank's exit code (0 when all
    succeed). A rank that fails ends the others after ``GRACE_S``, as the agent would."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    port = free_port()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        procs = [
            subprocess.Popen(
                [sys.executable, *argv],
                env=rank_env(base, rank, ranks, port),
                stdout=out,
                stderr=err,
                text=True,
            )
            for rank in range(ranks)
        ]
        code = wait_all(procs, timeout, list(argv))
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(argv), code, out.read(), err.read())


def wait_all(procs: list[subprocess.Popen], timeout: float, argv: list[str]) -> int:
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired(argv, timeout)
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed and failed_at is None:
                failed_at = now
            if failed_at is not None and now - failed_at > GRACE_S:
                break
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return next((p.returncode for p in procs if p.returncode != 0), 0)
