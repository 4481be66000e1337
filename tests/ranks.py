"""Real ranks without torchrun's agent: one process per rank, started with the variables
torchrun gives its workers, joined through a TCP store this process hosts (as the agent
hosts its own: ``TORCHELASTIC_USE_AGENT_STORE``, so forge takes the same path as under
torchrun), their output interleaved in one stdout and one stderr as under torchrun.

The agent is a process of its own that imports torch and holds a rendezvous: about 2 s of
every launch on this machine's 2 cores, and it proves nothing a test of forge's ranks asks.
The tests of torchrun itself (restarts, its shared store, a rank signalled under it) still
start torchrun. Each rank is forked from this worker's zygote (``tests/zygote.py``), which
has imported torch and forge once, where that starts it as a fresh process would
(``FORGE_TEST_FRESH_PROCESSES=1``: every rank a fresh process).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence

from torch.distributed import TCPStore

from tests.zygote import Forked, end_group, start_script
from tests.zygote import read as read_bytes

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


@contextlib.contextmanager
def started_ranks(
    ranks: int,
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    timeout: float,
    file_size_limit: int | None = None,
) -> Iterator[tuple[list[subprocess.Popen | Forked], str, str]]:
    """``python argv...`` started as ``ranks`` ranks joined through a store this process
    hosts; the ranks and the files of their interleaved stdout and stderr, each rank's group
    ended on leaving. ``file_size_limit``: each rank's ``ulimit -f``."""
    # faulthandler on: a rank that dies of a signal (SIGSEGV, SIGABRT) leaves every thread's
    # Python stack in the stderr a failing test shows (#46: the MoE tp=2 case's rare SIGSEGV
    # left none; docs/distributed.md, Tests)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        procs: list[subprocess.Popen | Forked] = []
        try:
            for rank in range(ranks):
                rank_vars = rank_env(base, rank, ranks, store.port)
                procs.append(start_script(argv, out, err, env=rank_vars,
                                          file_size_limit=file_size_limit))  # fmt: skip
            yield procs, out, err
        finally:
            for p in procs:
                end_group(p)


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
    with started_ranks(ranks, argv, env, timeout) as (procs, out, err):
        code = wait_all(procs, timeout)
        for p in procs:  # what they left running too, before their output is read
            end_group(p)
        stdout, stderr = read(out), read(err)
    if code is None:
        raise subprocess.TimeoutExpired(list(argv), timeout, stdout, stderr)
    return subprocess.CompletedProcess(list(argv), code, stdout, stderr)


def every_exit_code(
    ranks: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 180,
    file_size_limit: int | None = None,
) -> tuple[list[int], str, str]:
    """``python argv...`` as ``ranks`` ranks, started as ``run_ranks`` starts them, each left
    to end on its own (no rank is ended for another's failure): every rank's exit code, and
    the ranks' output. ``file_size_limit``: each rank's ``ulimit -f``."""
    with started_ranks(ranks, argv, env, timeout, file_size_limit) as (procs, out, err):
        codes = [p.wait(timeout) for p in procs]
        for p in procs:
            end_group(p)
        return codes, read(out), read(err)


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


def read(path: str) -> str:
    return read_bytes(path).decode(errors="replace")
