"""The warm interpreter the tests fork scripts from (tests/zygote.py) gives each script what a
fresh ``python script.py`` would: its argv (bytes included), environment, working folder,
exit code, output, atexit handlers and file-size limit; and a request it cannot honour by a
fork gets a fresh process."""

from __future__ import annotations

import os
import pathlib
import signal

import pytest

from tests.ranks import run_ranks
from tests.zygote import run_script, zygote

SCRIPT = """
import atexit, os, sys, warnings
atexit.register(lambda: print("atexit ran", flush=True))
print("argv", sys.argv[1:])
print("cwd", os.getcwd())
print("env", os.environ.get("ZYGOTE_PROBE"), os.environ.get("PYTHONWARNINGS"))
print("kmp", os.environ.get("KMP_DUPLICATE_LIB_OK"))
print("pid is group leader", os.getpgid(0) == os.getpid())
print("path0", sys.path[0])
print("main", __name__)
print("first warnings filter", warnings.filters[0][0])
print("parent", os.getppid())
action = sys.argv[1]
if action == "exit3":
    sys.exit(3)
if action == "message":
    sys.exit("a message")
if action == "raise":
    raise ValueError("boom")
if action == "write":
    with open("big", "wb") as f:
        f.write(b"x" * 100_000)
"""


@pytest.fixture
def script(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


# (action, exit code, what stderr holds)
ENDINGS = [
    ("ok", 0, ""),
    ("exit3", 3, ""),
    ("message", 1, "a message"),
    ("raise", 1, "ValueError: boom"),
]


@pytest.mark.parametrize("action,code,err", ENDINGS, ids=[e[0] for e in ENDINGS])
def test_a_forked_script_runs_as_a_fresh_one_would(script, action, code, err):
    warm = zygote()
    assert warm is not None
    assert warm.fits({**os.environ, "ZYGOTE_PROBE": "seen"}), warm.unfit_reason(os.environ)
    done = run_script([str(script), action, b"\xff"], env={"ZYGOTE_PROBE": "seen"})
    out = done.stdout.decode()
    assert f"parent {warm.proc.pid}" in out  # forked by the zygote, not a fresh process
    assert done.returncode == code, done.stderr.decode()
    assert err in done.stderr.decode()
    assert f"argv ['{action}', '\\udcff']" in out  # undecodable bytes as Python decodes argv
    assert f"cwd {os.getcwd()}" in out and "env seen None" in out
    assert "pid is group leader True" in out
    assert f"path0 {script.parent}" in out and "main __main__" in out
    assert out.rstrip().endswith("atexit ran")  # it left through the interpreter's exit


def test_a_file_size_limit_ends_the_write_as_ulimit_would(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done = run_script([str(script), "write"], file_size_limit=50_000)
    assert done.returncode == 1 and "File too large" in done.stderr.decode()


def test_an_environment_read_at_start_up_gets_a_fresh_process(script):
    warm = zygote()
    assert warm is not None
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    assert not warm.fits(env)
    assert warm.fits({**os.environ, "ZYGOTE_PROBE": "x"}), warm.unfit_reason(os.environ)
    done = run_script([str(script), "ok", "x"], env={"PYTHONWARNINGS": "error"})
    out = done.stdout.decode()
    assert done.returncode == 0 and "env None error" in out
    assert "first warnings filter error" in out  # read while it started: a fresh interpreter


def test_a_training_run_in_this_worker_leaves_later_scripts_forked(tiny_config):
    """What a run in the test worker's own process writes into its environment (inductor's
    cache folder, found lazily) must not make every later script a fresh interpreter: that
    cost ~5 s of CPU per launch, unseen, for the rest of the worker's tests."""
    from tests.e2e.test_train_script import TRAIN

    warm = zygote()
    assert warm is not None and warm.fits(dict(os.environ)), warm and warm.unfit_reason(os.environ)
    assert TRAIN.main([str(tiny_config), "--train.max_steps=3"]) == 0
    assert warm.fits(dict(os.environ)), warm.unfit_reason(os.environ)


def test_a_library_that_sets_an_openmp_variable_on_import_leaves_later_scripts_forked(
    script, monkeypatch
):
    """threadpoolctl sets ``KMP_DUPLICATE_LIB_OK`` when it is imported (a streamed
    ``load_dataset`` imports it, through scipy): read only by an OpenMP runtime the zygote has
    not loaded (torch's is GNU's), it reaches the forked child's environment as a fresh
    process's. Counted as read at start-up, it made every later script of that worker a
    fresh interpreter, and this module's tests failed there."""
    warm = zygote()
    assert warm is not None
    if warm.kmp_runtime:
        pytest.skip("this torch loads an OpenMP runtime that reads KMP_ variables")
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "True")  # what threadpoolctl's import does
    assert warm.fits(dict(os.environ)), warm.unfit_reason(os.environ)
    done = run_script([str(script), "ok"], env={"ZYGOTE_PROBE": "kmp"})
    out = done.stdout.decode()
    assert f"parent {warm.proc.pid}" in out and "kmp True" in out


CRASH = """
import ctypes, os
def read_address_zero():
    ctypes.string_at(0)  # SIGSEGV
if os.environ["RANK"] == "1":
    read_address_zero()
"""


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_rank_that_dies_of_a_signal_names_its_python_stack(tmp_path, fresh):
    """faulthandler is on in every rank of ``run_ranks`` (forked or a fresh process): a
    SIGSEGV leaves the rank's Python stack in the output a failing test shows."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    env = {"PYTHONWARNINGS": "default"} if fresh else None  # read at start-up: a fresh process
    done = run_ranks(2, [str(script)], env=env)
    assert done.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert "in read_address_zero" in done.stderr, done.stderr
