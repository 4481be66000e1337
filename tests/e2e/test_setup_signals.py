"""Set-up honours signals, and a store that does not answer is named in bounded time. Each row
runs ``scripts/train.py`` as a real process (a session of its own, signalled as a terminal or
a scheduler signals it: the whole group) and stops it during set-up: while it waits on an
object store that accepts connections and never answers, in a later phase, in a rendezvous
that waits for a peer. It ends within seconds, exit 75 (SIGTERM) or 130 (Ctrl-C), in one
line, with no run directory left and no save promised."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from forge.resilience.signals import PAUSE_ENV, SETUP_GRACE_S
from forge.types import ExitCode
from tests.e2e.sandbox import TRAIN, Run
from tests.object_store import ENV, free_port, silent_server
from tests.zygote import end_group, read, start_script

SOON_S = 3.0  # "within seconds": a signal handled where set-up is
SAVE_PROMISED = "saving a checkpoint"


@pytest.fixture
def silent() -> Iterator[tuple[str, threading.Event]]:
    with silent_server() as server:
        yield server


def store_env(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return env | ENV | {"AWS_ENDPOINT_URL": endpoint}


class Launched:
    """``train.py`` on the sandbox's config, started, its output in files of the sandbox."""

    def __init__(self, run: Run, *args: str, env: dict[str, str]) -> None:
        self.out, self.err = run.root / "stdout", run.root / "stderr"
        for path in (self.out, self.err):
            path.write_bytes(b"")
        argv = [*TRAIN[1:], str(run.config), *args]
        self.proc = start_script(argv, str(self.out), str(self.err), env=env)

    @property
    def stderr(self) -> str:
        return read(str(self.err)).decode()

    def wait_for(self, ready: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert self.proc.poll() is None, f"ended before {what}: {self.stderr[-2000:]}"
            assert time.monotonic() < deadline, f"no {what} in {timeout_s} s"
            time.sleep(0.02)

    def stopped_by(self, sig: signal.Signals, within_s: float) -> tuple[int, float]:
        """Signal the run's group; its exit code and how long it took to end (the test fails
        when it is still running ``within_s`` later)."""
        start = time.monotonic()
        os.killpg(self.proc.pid, sig)
        try:
            code = self.proc.wait(within_s)
        finally:
            end_group(self.proc)
        return code, time.monotonic() - start


def ended_in_one_line(launched: Launched, sig: signal.Signals, run: Run) -> None:
    err = launched.stderr
    assert f"[forge] interrupted ({sig.name}) during set-up: stopped before training" in err
    assert "Traceback" not in err and SAVE_PROMISED not in err, err[-3000:]
    assert not run.dir.exists()  # nothing written, nothing claimed


STOPS = [(signal.SIGTERM, ExitCode.SHUTDOWN), (signal.SIGINT, ExitCode.INTERRUPTED)]


@pytest.mark.parametrize("sig,code", STOPS, ids=[s.name for s, _ in STOPS])
def test_a_signal_while_the_store_probe_waits_ends_set_up_within_seconds(
    sandbox, silent, sig, code
):
    endpoint, accepted = silent
    run = Launched(sandbox, "--checkpoint.dir=s3://bucket/run", env=store_env(endpoint))
    run.wait_for(accepted.is_set, "connection to the store")
    got, took = run.stopped_by(sig, SOON_S)
    assert got == code and took < SOON_S, run.stderr[-3000:]
    ended_in_one_line(run, sig, sandbox)


def test_a_store_that_does_not_answer_is_named_within_its_timeout(sandbox, silent):
    endpoint, accepted = silent
    args = ["--checkpoint.dir=s3://bucket/run", "--checkpoint.storage_timeout_s=1"]
    run = Launched(sandbox, *args, env=store_env(endpoint))
    run.wait_for(accepted.is_set, "connection to the store")
    start = time.monotonic()
    code = run.proc.wait(1 + SOON_S)
    took = time.monotonic() - start
    errors = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    assert code == ExitCode.CONFIG_ERROR and took < 1 + SOON_S, run.stderr[-3000:]
    assert errors == [
        f"error: checkpoint.dir: s3://bucket/run: the store at {endpoint} did not answer "
        "within checkpoint.storage_timeout_s=1 s; check that the endpoint is the store's and "
        "that it is up (AWS_ENDPOINT_URL or checkpoint.storage_options for S3), or raise "
        "checkpoint.storage_timeout_s for a store that is slow to answer"
    ]
    assert not sandbox.dir.exists()


def test_ctrl_c_in_a_later_phase_releases_the_run_directory_and_promises_no_save(sandbox):
    """After the run directory is claimed (created and locked), before the checkpoint is
    looked for: the directory goes again, and the first Ctrl-C promises no save."""
    run = Launched(sandbox, env={**os.environ, PAUSE_ENV: "checkpoint"})
    run.wait_for(lambda: "set-up waits at checkpoint" in run.stderr, "pause")
    assert sandbox.dir.is_dir()  # claimed
    code, _ = run.stopped_by(signal.SIGINT, SOON_S)
    assert code == ExitCode.INTERRUPTED, run.stderr[-3000:]
    ended_in_one_line(run, signal.SIGINT, sandbox)


def test_sigterm_while_a_rendezvous_waits_for_a_peer_ends_the_process(sandbox):
    """Rank 0 of two, alone: the rendezvous waits in C++ for rank 1 and runs no Python
    handler until it returns. The signal still ends the process, a grace period later."""
    port = free_port()
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    world |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    run = Launched(sandbox, env={**os.environ, **world})
    run.wait_for(lambda: listening(port), "rendezvous")
    code, took = run.stopped_by(signal.SIGTERM, SETUP_GRACE_S + SOON_S)
    assert code == ExitCode.SHUTDOWN and took >= 1, run.stderr[-3000:]
    err = run.stderr
    assert "[forge] interrupted (SIGTERM) during set-up: a call that does not return" in err
    assert "Traceback" not in err and SAVE_PROMISED not in err, err[-3000:]
    assert not sandbox.dir.exists()  # the rendezvous comes before the run directory


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def importing_torch(pid: int) -> bool:
    """Whether process ``pid`` has begun importing torch (its library is mapped): the second
    or so of imports that follows runs before set-up's own handlers exist."""
    try:
        return "libtorch_cpu.so" in pathlib.Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


IMPORTS_S = 15.0  # the rest of torch's imports and the config's checks, on a loaded machine
# (case, signal, extra arguments, exit code, the whole of stderr)
DURING_IMPORTS = [
    ("SIGTERM", signal.SIGTERM, [], ExitCode.SHUTDOWN, "[forge] interrupted (SIGTERM) during set-up: stopped before training; nothing was written\n"),
    ("Ctrl-C", signal.SIGINT, [], ExitCode.INTERRUPTED, "[forge] interrupted (SIGINT) during set-up: stopped before training; nothing was written\n"),
    # a launcher's SIGTERM to a rank whose peer refused the same config (torchrun, srun's
    # --kill-on-bad-exit) must not turn the refusal into a retryable 75 on this rank
    ("SIGTERM with a bad config: the config named", signal.SIGTERM, ["--optimizer.lr=nan"], ExitCode.CONFIG_ERROR, "error: optimizer.lr: expected a finite number, got nan\n"),
]  # fmt: skip


@pytest.mark.parametrize(
    "sig,args,code,err", [d[1:] for d in DURING_IMPORTS], ids=[d[0] for d in DURING_IMPORTS]
)
def test_a_signal_during_the_scripts_imports_waits_for_the_configs_checks(
    sandbox, sig, args, code, err
):
    """A fresh process (the zygote's have torch imported already), signalled while it imports
    torch: the script holds the signal from its first statement until its config is checked
    (SIGTERM's default ended it with no word, and SIGINT's in a traceback from inside an
    import)."""
    path = sandbox.root / "stderr"
    with path.open("wb") as f:
        proc = subprocess.Popen([*TRAIN, str(sandbox.config), *args], stdout=subprocess.DEVNULL,
                                stderr=f, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not importing_torch(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, path.read_text()[-2000:]
            time.sleep(0.002)
        os.killpg(proc.pid, sig)
        got = proc.wait(IMPORTS_S)
    finally:
        end_group(proc)
    assert (got, path.read_text()) == (code, err)
    assert not sandbox.dir.exists()
