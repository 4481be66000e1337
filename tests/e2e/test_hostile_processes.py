"""Hostile processes and moments: two runs on one directory, a full disk in every save mode,
damaged newest checkpoints, signals from outside, a NaN on the last step. Each runs
``scripts/train.py`` as a real process."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from forge.checkpoint.store import load_checkpoint
from forge.config import load_config
from forge.model.transformer import Transformer
from forge.training.records.run_dir import lock_directories
from tests.conftest import REPO
from tests.e2e.sandbox import TRAIN, Result, Run, copy_trained, train
from tests.launched import Launched, launch
from tests.zygote import run_script

STALL = "stall:step=2:seconds=60"  # holds the run (and its lock) after step 2


def start(run: Run, *args: str, env: dict[str, str] | None = None) -> Launched:
    return launch([*TRAIN[1:], str(run.config), *args], {**os.environ, **(env or {})})


def steps_logged(run: Run) -> list[int]:
    lines = (run.dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines]


def test_a_second_process_on_the_same_run_dir_is_refused_naming_the_holder(sandbox):
    first = start(sandbox, "--checkpoint.interval=100", env={"FORGE_FAULTS": STALL})
    try:
        first.wait_for_output("step 2 |")
        second = train(sandbox)
        assert second.code == 2 and "Traceback" not in second.stderr
        assert len(second.errors) == 1
        assert f"run.dir: {sandbox.dir} is in use by pid {first.pid} on host" in second.errors[0]
        assert steps_logged(sandbox) == [1, 2]  # the second process wrote nothing there
    finally:
        first.kill()  # SIGKILL: the OS drops the lock with the process
    third = train(sandbox, "--train.max_steps=4")
    assert third.code == 0, third.stderr  # no stale lock


def test_a_checkpoint_dir_shared_by_two_run_dirs_is_refused(sandbox):
    shared = sandbox.root / "shared-checkpoints"
    held = lock_directories([("checkpoint.dir", shared)])  # another run holds it, in this process
    try:
        result = train(sandbox, f"--checkpoint.dir={shared}")
    finally:
        held.release()
    assert result.code == 2 and "Traceback" not in result.stderr
    assert len(result.errors) == 1
    assert f"checkpoint.dir: {shared} is in use by pid {os.getpid()}" in result.errors[0]
    assert not (sandbox.dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("mode", ["disabled", "async", "async_process"])
def test_a_full_disk_fails_the_final_save_in_one_line_and_keeps_the_last_checkpoint(
    sandbox, trained, mode
):
    copy_trained(trained, sandbox)
    proc = train(
        sandbox, "--train.max_steps=12", "--checkpoint.interval=11",
        f"--checkpoint.async_mode={mode}",
        file_size_limit=100_000,  # a shard of the tiny model is ~0.4 MB
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.code == 5, proc.stderr
    warnings = [x for x in proc.stderr.splitlines() if "saving step 11 failed" in x]
    assert len(warnings) == 1 and "training goes on" in warnings[0]  # a periodic save
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1
    assert f"checkpoint.dir {sandbox.ckpt}: saving step 12 failed" in errors[0]
    assert "File too large" in errors[0]
    assert errors[0].endswith(  # what to do, once: the periodic warning says training goes on
        "; the run ends: relaunch it once that is mended (it resumes from the last committed "
        "checkpoint)"
    )
    assert os.readlink(sandbox.ckpt / "latest") == "step_10"
    assert sorted(p.name for p in sandbox.ckpt.glob("step_*")) == ["step_10", "step_5"]
    model = Transformer(load_config([str(sandbox.config)]).config.model)
    load_checkpoint(sandbox.ckpt / "step_10", model, None)  # still loadable


def export(args: list[str]) -> Result:
    """``scripts/convert_checkpoint.py export args...`` as a process of its own."""
    done = run_script([str(REPO / "scripts" / "convert_checkpoint.py"), "export", *args])
    return Result(done.returncode, done.stdout.decode(), done.stderr.decode())


def truncate_rng(path):
    rng = path / "rng_rank0.pt"
    rng.write_bytes(rng.read_bytes()[:100])


def wrong_train_state_shape(path):
    (path / "train_state.json").write_text(json.dumps({"step": "four"}))


def random_metadata(path):
    (path / ".metadata").write_bytes(bytes(range(7, 256)) * 3)


@pytest.mark.parametrize("damage", [truncate_rng, wrong_train_state_shape, random_metadata])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(sandbox, trained, damage):
    copy_trained(trained, sandbox)
    damage(sandbox.ckpt / "step_10")
    result = train(sandbox, "--train.max_steps=12")
    assert result.code == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"skipping unloadable checkpoint {sandbox.ckpt / 'step_10'}" in result.stderr
    assert f"resumed from {sandbox.ckpt / 'step_5'} at step 5" in result.stderr
    assert steps_logged(sandbox) == list(range(1, 13))


def test_export_falls_back_like_training(sandbox, trained):
    copy_trained(trained, sandbox)
    truncate_rng(sandbox.ckpt / "step_10")
    out = export([str(sandbox.dir), "--out", str(sandbox.root / "export"), "--dtype", "float32"])
    assert out.code == 0, out.stderr
    assert "skipping unloadable checkpoint" in out.stderr
    assert f"exported {sandbox.ckpt / 'step_5'}" in out.stdout


def test_export_of_a_named_damaged_checkpoint_names_it_and_falls_back_to_none(sandbox, trained):
    """The checkpoint named on the command line is the one read: damaged, it is refused by
    its own path (not as "no checkpoint there loads" with a training key to change), and no
    older one is exported in its place."""
    copy_trained(trained, sandbox)
    truncate_rng(sandbox.ckpt / "step_10")
    out = export([str(sandbox.ckpt / "step_10"), "--out", str(sandbox.root / "export")])
    assert out.code == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"error: {sandbox.ckpt / 'step_10'}: does not load (")
    assert "rng_rank0.pt" in line  # the damage, as the checkpoint's reader found it
    assert line.endswith(
        "; name another checkpoint of the run, or the run directory to read its newest that loads"
    )
    assert not (sandbox.root / "export").exists()


def test_allow_config_change_resumes_with_a_warning_listing_the_differences(sandbox, trained):
    copy_trained(trained, sandbox)
    result = train(
        sandbox, "--train.max_steps=12", "--model.rope_theta=500000",
        "--checkpoint.allow_config_change=true",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    assert "warning: resuming" in result.stderr
    assert "model.rope_theta: 10000.0 → 500000.0" in result.stderr


def test_a_loader_position_the_loader_cannot_take_is_damage_and_the_older_checkpoint_loads(
    sandbox, trained
):
    """step_10's loader record edited to rows 41 with its cursors at 40 (the same length, and
    only lengths verified): found before any tensor loads, reported, and step_5 resumes."""
    copy_trained(trained, sandbox)
    state = sandbox.ckpt / "step_10" / "train_state.json"
    text = state.read_text()
    assert '"rows": 40' in text
    state.write_text(text.replace('"rows": 40', '"rows": 41'))
    result = train(sandbox, "--train.max_steps=12", "--checkpoint.verify=metadata")
    assert result.code == 0, result.stderr
    assert "skipping unloadable checkpoint" in result.stderr and "does not add up" in result.stderr
    assert "resumed from" in result.stderr and "step_5 at step 5" in result.stderr


def test_sigusr1_from_outside_saves_and_exits_75(sandbox):
    proc = start(
        sandbox, "--checkpoint.interval=100", env={"FORGE_FAULTS": "stall:step=2:seconds=3"}
    )
    proc.wait_for_output("step 2 |")
    proc.signal(signal.SIGUSR1)  # seen at the next step boundary, after the stall
    code, _, err = proc.finish(timeout=120)
    assert code == 75, err
    assert "Traceback" not in err
    state = json.loads((sandbox.ckpt / "step_3" / "train_state.json").read_text())
    assert state["reason"] == "emergency"


def test_two_ctrl_c_abandon_the_save_and_exit_130_with_latest_complete(sandbox):
    proc = start(sandbox, "--checkpoint.interval=2", env={"FORGE_FAULTS": STALL})
    proc.wait_for_output("step 2 |")  # step_2 is committed before the stall
    proc.signal(signal.SIGINT)
    time.sleep(0.5)
    proc.signal(signal.SIGINT)
    code, _, err = proc.finish(timeout=120)
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "second interrupt: abandoning the save in progress" in err
    assert os.readlink(sandbox.ckpt / "latest") == "step_2"
    model = Transformer(load_config([str(sandbox.config)]).config.model)
    load_checkpoint(sandbox.ckpt / "step_2", model, None)


def test_a_nan_on_the_last_step_saves_the_finite_state(sandbox, tmp_path):
    same_lr = ("--checkpoint.interval=100", "--scheduler.decay_steps=10")
    result = train(sandbox, "--train.max_steps=5", *same_lr, env={"FORGE_FAULTS": "nan:step=5"})
    assert result.code == 0, result.stderr
    state = json.loads((sandbox.ckpt / "step_5" / "train_state.json").read_text())
    assert state["reason"] == "final" and state["loop_state"]["last_step_finite"] is False
    reference = train(sandbox, f"--run.dir={tmp_path / 'ref'}", "--train.max_steps=4", *same_lr)
    assert reference.code == 0, reference.stderr
    model = Transformer(load_config([str(sandbox.config)]).config.model)
    load_checkpoint(sandbox.ckpt / "step_5", model, None)
    skipped = {k: v.clone() for k, v in model.state_dict().items()}
    load_checkpoint(tmp_path / "ref" / "checkpoints" / "step_4", model, None)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, skipped[name]), name  # the weights of step 4
