"""A script started in the background, as a user starts it beside a test: a process of its own
(forked from the warm interpreter, ``tests/zygote.py``, where that starts it as a fresh one
would; else, or when asked, a fresh interpreter), its stdout and stderr in files the test
reads while it runs. What ``subprocess.Popen`` with pipes gave these tests, without paying a
fresh interpreter's imports (about 4 s of CPU each on a 2-core AVX2 machine) per launch."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

import attrs

from tests.zygote import Forked, end_group, start_script

POLL_S = 0.01


@attrs.frozen
class Launched:
    proc: subprocess.Popen | Forked
    out: pathlib.Path
    err: pathlib.Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float = 240) -> int:
        """Its exit code (``subprocess.TimeoutExpired`` past ``timeout``)."""
        return self.proc.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stdout(self) -> str:
        """What it printed so far ("" once ``finish`` has removed the file)."""
        return read(self.out)

    def stderr(self) -> str:
        return read(self.err)

    def wait_for_output(self, text: str, timeout: float = 120) -> str:
        """Its stdout once ``text`` is in it; fails if it ends first or at ``timeout``."""
        deadline = time.monotonic() + timeout
        while text not in (out := self.stdout()):
            assert self.poll() is None, f"it ended before printing {text!r}: {self.stderr()}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s: {out}"
            time.sleep(POLL_S)
        return out

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        """Its exit code (SIGKILLed at ``timeout``: -9), stdout and stderr; what it left
        running (loader workers, a checkpoint process) ended, its files removed."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        end_group(self.proc)
        assert self.proc.returncode is not None
        outputs = self.stdout(), self.stderr()
        for path in (self.out, self.err):
            path.unlink(missing_ok=True)
        return self.proc.returncode, *outputs

    def kill(self) -> int:
        """SIGKILL it and what it started, if it runs; its exit code."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.signal(signal.SIGKILL)
        return self.finish(timeout=60)[0]


def launch(
    argv: Sequence[str], env: Mapping[str, str] | None = None, *, fresh: bool = False
) -> Launched:
    """``python argv...`` in a session of its own; ``env``: the whole environment (default:
    this one's); ``fresh``: a new interpreter even where a fork would do (its own
    string-hash seed, nothing inherited from the warm one)."""
    out, err = (log_file(suffix) for suffix in (".out", ".err"))
    if not fresh:
        return Launched(start_script(argv, str(out), str(err), env=env), out, err)
    with out.open("ab") as stdout, err.open("ab") as stderr:
        proc = subprocess.Popen([sys.executable, *argv], stdout=stdout, stderr=stderr,
                                env=None if env is None else dict(env),
                                start_new_session=True)  # fmt: skip
    return Launched(proc, out, err)


def log_file(suffix: str) -> pathlib.Path:
    handle, name = tempfile.mkstemp(prefix="launched-", suffix=suffix)
    os.close(handle)
    return pathlib.Path(name)


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout_s: float = 120) -> None:
    """Read ``proc``'s stdout pipe (a process started with ``stdout=PIPE``, a shell script's
    for one) until a line starts with ``prefix``."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process ended before printing {prefix!r}")
        if line.startswith(prefix):
            return
    raise AssertionError(f"no line {prefix!r} within {timeout_s} s")


def read(path: pathlib.Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
