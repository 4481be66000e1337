"""Real ranks without torchrun's agent: one process per rank, started with the variables
torchrun gives its workers, joined through a TCP store this process hosts (as the agent
hosts its own: ``TORCHELASTIC_USE_AGENT_STORE``, so forge takes the same path as under
torchrun), their output interleaved in one stdout and one stderr as under torchrun.

The agent is a process of its own that imports torch and holds a rendezvous: about 2 s of
every launch on this machine's 2 cores, and it proves nothing a test of forge's ranks asks.
The tests of torchrun itself (restarts, its shared store, a rank signalled under it) still
start torchrun. Each rank is forked from this worker's zygote (``tests/zygote.py``), which
has imported torch and forge once, where that starts it as a fresh process would
(``FORGE_TEST_FRESH_RANKS=1``: every rank a fresh process).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from torch.distributed import TCPStore

from tests.zygote import Forked, Zygote, zygote

POLL_S = 0.05
GRACE_S = 10.0  # after a rank fails, how long the others may take to fail alike


def rank_env(env: Mapping[str, str], rank: int, ranks: int, port: int) -> dict[str, str]:
    """What torchrun's agent sets for worker ``rank`` of ``ranks`` on one node, its store at
    ``port``, in its first round."""
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def run_ranks(
    ranks: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """``python argv...`` as ``ranks`` ranks; the exit code of the first rank that failed on
    its own (0 when all succeed). A rank that fails ends the others after ``GRACE_S``, as
    the agent would; so does ``timeout`` (``TimeoutExpired``, with the ranks' output)."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
    warm = None if os.environ.get("FORGE_TEST_FRESH_RANKS") == "1" else zygote()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        procs: list[subprocess.Popen | Forked] = []
        try:
            for rank in range(ranks):
                procs.append(start(warm, argv, rank_env(base, rank, ranks, store.port), out, err))
            code = wait_all(procs, timeout)
        finally:
            for p in procs:
                end_group(p)
        if code is None:
            raise subprocess.TimeoutExpired(list(argv), timeout, read(out), read(err))
        return subprocess.CompletedProcess(list(argv), code, read(out), read(err))


def start(
    warm: Zygote | None, argv: Sequence[str], env: dict[str, str], out: str, err: str
) -> subprocess.Popen | Forked:
    """One rank: forked from the zygote where that starts it as a fresh process would, else
    a fresh process."""
    if warm is not None and warm.fits(env):
        return warm.start(argv, env, out, err)
    with open(out, "a") as stdout, open(err, "a") as stderr:
        return subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # a group of its own: its children end with it
        )


def wait_all(procs: Sequence[subprocess.Popen | Forked], timeout: float) -> int | None:
    """The first failure's exit code, 0 when every rank succeeded, None at the timeout."""
    deadline = time.monotonic() + timeout
    first: int | None = None
    failed_at = 0.0
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            return None
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and first is None:
            first, failed_at = failed[0], now
        if first is not None and now - failed_at > GRACE_S:
            return first
        time.sleep(POLL_S)
    if first is not None:
        return first
    return next((p.returncode for p in procs if p.returncode != 0), 0)


def end_group(proc: subprocess.Popen | Forked) -> None:
    """Kill what is left of ``proc``'s group: the rank, and what it started and left behind
    (loader workers, a checkpoint process)."""
    with contextlib.suppress(ProcessLookupError):  # none left: all of it has ended
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # a forked rank not yet in its own group
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def read(path: str) -> str:
    with open(path, errors="replace") as file:
        return file.read()
