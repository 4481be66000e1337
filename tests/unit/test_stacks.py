"""A rank's stacks file (forge/resilience/stacks.py): what an attempt keeps and takes back."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys

import pytest

from forge.resilience.stacks import StackWatch, stack_watch, stacks_path
from forge.types import LoopOutcome, LoopState


def watchdog_dump(watch: StackWatch) -> None:
    """What the watchdog writes when it fires (here at once, from this thread)."""
    faulthandler.dump_traceback(watch.file, all_threads=True)
    watch.file.flush()


EARLIER = "an earlier attempt's stacks\n"
# (what was there before, whether a failure is recorded, the file kept)
CASES = [(None, False, False), (None, True, True), (EARLIER, False, True), (EARLIER, True, True)]


@pytest.mark.parametrize("before,fails,kept", CASES)
def test_an_attempt_keeps_its_stacks_only_when_it_recorded_a_failure(tmp_path, before, fails, kept):
    path = stacks_path(tmp_path, 0)
    if before is not None:
        path.parent.mkdir()
        path.write_text(before)
    with stack_watch(tmp_path, 0, 2, 60.0) as watch:
        assert watch is not None
        watchdog_dump(watch)  # a slow stretch
        if fails:
            watch.record("rank 0: boom")
    assert path.exists() is kept
    if not kept:
        assert not path.parent.exists()  # no empty folder left in a healthy run
    else:
        text = path.read_text()
        assert text.startswith(before or "")
        if fails:  # the dump of the stretch that failed, the line, the stacks then
            dump, line, stacks = text[len(before or "") :].partition("rank 0: boom\n")
            assert "most recent call first" in dump and line and "File" in stacks
        else:
            assert text == before  # the slow stretch's dump was taken back


def test_progress_takes_back_the_watchdog_dump_of_a_slow_stretch(tmp_path):
    with stack_watch(tmp_path, 1, 2, 60.0) as watch:
        assert watch is not None
        watchdog_dump(watch)
        assert stacks_path(tmp_path, 1).stat().st_size > 0
        watch.arm()  # the next step ended: progress
        assert stacks_path(tmp_path, 1).stat().st_size == 0
        watchdog_dump(watch)
        watch.record("rank 1: boom")
        watch.arm()  # once a failure is recorded, nothing is taken back
        assert "most recent call first" in stacks_path(tmp_path, 1).read_text().split("rank 1")[0]


def test_an_exception_that_ends_the_rank_is_recorded_with_its_stacks(tmp_path):
    with pytest.raises(ValueError), stack_watch(tmp_path, 0, 2, 60.0):
        raise ValueError("broken")
    text = stacks_path(tmp_path, 0).read_text()
    assert text.startswith("rank 0: the run ended with ValueError: broken\n") and "File" in text


def test_a_single_process_has_no_watch_and_writes_nothing(tmp_path):
    with stack_watch(tmp_path, 0, 1, 60.0) as watch:
        assert watch is None
    assert not (tmp_path / "stacks").exists()


def test_a_run_dir_it_cannot_write_is_a_warning_not_a_failure(tmp_path, capsys):
    (tmp_path / "stacks").write_text("a file where the folder goes")
    with stack_watch(tmp_path, 0, 2, 60.0) as watch:
        assert watch is None
    assert "warning: rank 0: no stacks file" in capsys.readouterr().err


@pytest.mark.parametrize("outcome", list(LoopOutcome))
def test_only_a_health_failure_at_the_end_is_recorded(tmp_path, outcome):
    with stack_watch(tmp_path, 0, 2, 60.0) as watch:
        assert watch is not None
        watch.on_train_end(outcome, LoopState(step=4))
    kept = outcome is LoopOutcome.HEALTH_FAILURE
    assert stacks_path(tmp_path, 0).exists() is kept
    if kept:
        assert (
            stacks_path(tmp_path, 0).read_text().startswith("the health check failed after step 4")
        )


CRASH = """
import ctypes
from forge.resilience.stacks import native_crash_stacks
print(native_crash_stacks(), flush=True)
ctypes.string_at(0)
"""


@pytest.mark.parametrize("asked", [True, False], ids=["faulthandler on", "off"])
def test_torch_s_native_stacks_only_where_faulthandler_is_on(asked):
    """Asked for (``PYTHONFAULTHANDLER=1``), a SIGSEGV prints every thread's C++ frames and
    then the Python stack; not asked for, torch's handler stays off (it is not
    async-signal-safe) and nothing is printed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    if asked:
        env["PYTHONFAULTHANDLER"] = "1"
    done = subprocess.run([sys.executable, "-c", CRASH], env=env, capture_output=True, text=True)
    assert done.returncode == -11
    assert done.stdout == f"{asked}\n"
    assert ("SIGSEGV(11), PID: " in done.stderr) is asked, done.stderr[-2000:]
    assert ("Fatal Python error: Segmentation fault" in done.stderr) is asked
