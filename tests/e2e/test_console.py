"""A console that goes away (``forge.console``): a pipe whose reader closed (``| head``), a
full device. The train script goes on with its files and checkpoints (the console only
echoes them) and ends with its own exit code; a script that reads a run ends as it would
have. Each case a real process, its pipe closed before its first line."""

from __future__ import annotations

import errno
import io
import json
import subprocess
import sys

import pytest

from forge.console import DroppingStream
from forge.metrics.goodput import read_ledger
from tests.conftest import REPO
from tests.e2e.sandbox import TRAIN

GOODPUT = [sys.executable, str(REPO / "scripts" / "goodput.py")]


def closed_pipe(argv: list[str], stderr_too: bool) -> tuple[int, str]:
    """``argv`` run with its stdout (and its stderr, with ``stderr_too``) a pipe whose reader
    closed before the first line; its exit code and, otherwise, its stderr."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if stderr_too else subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone
    _, err = proc.communicate(timeout=120)
    return proc.returncode, (err or b"").decode()


@pytest.mark.parametrize("stderr_too", [True, False], ids=["stdout and stderr", "stdout"])
def test_a_run_whose_console_closes_trains_and_records_to_its_end(sandbox, stderr_too):
    code, err = closed_pipe([*TRAIN, str(sandbox.config)], stderr_too)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err
    steps = [json.loads(line)["step"] for line in (sandbox.dir / "metrics.jsonl").open()]
    assert steps[-1] == 12  # every record written
    assert (sandbox.ckpt / "step_12").is_dir()
    (launch,) = read_ledger(sandbox.dir / "goodput.jsonl")
    assert launch.ended and launch.completed  # its last line, at its end
    code, err = closed_pipe([*GOODPUT, str(sandbox.dir)], stderr_too=False)
    assert code == 0 and err == "", err  # a reader of the run, as `| head` cuts it


class Gone(io.StringIO):
    def __init__(self, error: int) -> None:
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        raise OSError(self.error, "failed")


# (case, the error a write meets, whether the console is dropped or the error raised)
ERRORS = [
    ("its pipe's reader closed", errno.EPIPE, True),
    ("its terminal hung up", errno.EIO, True),
    ("its device is full", errno.ENOSPC, True),
    ("past the file-size limit", errno.EFBIG, True),
    ("anything else is not the console going away", errno.EACCES, False),
]


@pytest.mark.parametrize("error,dropped", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_a_console_is_dropped_only_when_it_went_away(error, dropped):
    stream = DroppingStream(Gone(error))  # type: ignore[arg-type]
    if dropped:
        assert stream.write("a line\n") == len("a line\n")
        assert stream.gone
        stream.write("another\n")  # dropped too, not written
    else:
        with pytest.raises(OSError):
            stream.write("a line\n")
        assert not stream.gone
