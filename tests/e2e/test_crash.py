"""SIGKILL at many moments, async saves included: a loadable checkpoint always remains,
``latest`` never dangles, and the resumed run continues exactly as the uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from forge.checkpoint.resume import ResumeSource, resolve_resume
from forge.checkpoint.store import is_complete
from tests.conftest import REPO
from tests.e2e.test_train_script import TRAIN, run_dir
from tests.zygote import end_group, run_script, start_script

ARGS = [
    "--train.max_steps=30",  # the latest kill lands by step ~8 here, ~15 on a 2x faster CPU
    "--checkpoint.interval=1",  # a save every step: kills land inside saves
    "--checkpoint.keep_last_n=2",
    "--checkpoint.async_mode=async",
    "--data.verify_checksum=false",
    "--metrics.log_interval=1",
]
KILL_AFTER_S = [0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.2]


def command(config):
    return [sys.executable, str(REPO / "scripts" / "train.py"), str(config), *ARGS]


def losses(config):
    lines = (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus):
    from tests.conftest import TINY

    tmp = tmp_path_factory.mktemp("crash_ref")
    config = tmp / "tiny.toml"
    config.write_text(TINY.format(data=small_corpus) + f'\n[run]\ndir = "{run_dir(config)}"\n')
    done = run_script(command(config)[1:])  # forked from a warm interpreter: tests/zygote.py
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return config


@pytest.mark.parametrize("delay", KILL_AFTER_S)
def test_kill_at_any_moment_leaves_a_resumable_run(reference, tiny_config, tmp_path, delay):
    out = tmp_path / "stdout"
    out.touch()
    proc = start_script(command(tiny_config)[1:], str(out), os.devnull)  # tests/zygote.py
    deadline = time.monotonic() + 120
    while b"\n" not in out.read_bytes():  # the first logged step: training has started
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.01)
    time.sleep(delay)
    assert proc.poll() is None, "the run ended before its kill: raise train.max_steps in ARGS"
    os.kill(proc.pid, signal.SIGKILL)
    end_group(proc)
    ckpt = run_dir(tiny_config) / "checkpoints"
    latest = ckpt / "latest"
    if latest.is_symlink():
        assert is_complete(ckpt / os.readlink(latest)), "latest points at an incomplete checkpoint"
    plan = resolve_resume(ckpt, None)
    assert plan.source in (ResumeSource.CHECKPOINT_DIR, ResumeSource.FRESH)
    # the resume needs no process of its own (the kill did): in this one, no start-up to pay
    assert TRAIN.main([str(tiny_config), *ARGS]) == 0
    assert losses(tiny_config) == losses(reference)
    assert not list(ckpt.glob("*.tmp"))
