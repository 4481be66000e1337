"""A run directory's records beside its checkpoints: the config history a resume with changes
keeps (``config.toml`` never overwritten), and a disk that cannot take them: a full disk or a
file-size limit while writing ``config.toml`` or ``metrics.jsonl`` stops the run cleanly,
with its work saved and nothing half-written."""

from __future__ import annotations

import json
import os

from forge.training.run_dir import load_run_config
from forge.training.run_records import recorded_configs
from tests.e2e.sandbox import Run, copy_trained, train, train_here


def steps_logged(run: Run) -> list[int]:
    lines = (run.dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if "loss" in json.loads(x)]


def records(run: Run) -> dict[str, bytes]:
    """The run directory's files but the lock (which names the latest holder)."""
    return {
        p.name: p.read_bytes() for p in run.dir.iterdir() if p.is_file() and p.name != ".forge.lock"
    }


def test_a_resume_with_changes_records_its_config_beside_the_original(sandbox, trained):
    copy_trained(trained, sandbox)
    original = (sandbox.dir / "config.toml").read_text()
    result = train_here(sandbox, "--train.max_steps=12", "--metrics.log_interval=2")
    assert result.code == 0, result.stderr
    assert (sandbox.dir / "config.toml").read_text() == original  # never overwritten
    assert sorted(recorded_configs(sandbox.dir)) == [0, 10]
    newer = (sandbox.dir / "config.step_10.toml").read_text()
    assert "max_steps = 12" in newer and "log_interval = 2" in newer
    assert load_run_config(sandbox.dir).metrics.log_interval == 2  # the config in force
    # the same config again: already complete, nothing new
    again = train_here(sandbox, "--train.max_steps=12", "--metrics.log_interval=2")
    assert again.code == 0 and sorted(recorded_configs(sandbox.dir)) == [0, 10]


def test_a_resume_at_an_earlier_step_drops_the_configs_of_the_steps_it_discards(sandbox, trained):
    copy_trained(trained, sandbox)
    (sandbox.dir / "config.step_12.toml").write_text("# a branch that crashed past step 10\n")
    result = train_here(sandbox, "--train.max_steps=12")
    assert result.code == 0, result.stderr
    assert sorted(recorded_configs(sandbox.dir)) == [0, 10]


def test_config_toml_past_the_file_size_limit_is_one_line_and_leaves_no_run_dir(sandbox):
    result = train(sandbox, file_size_limit=1024)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.code == 2, result.stderr
    assert len(result.errors) == 1, result.stderr
    assert (
        f"run.dir: cannot write {sandbox.dir / 'config.toml'} (File too large)"
        in (result.errors[0])
    )
    assert not sandbox.dir.exists(), list(sandbox.dir.iterdir())


def test_a_resume_past_the_file_size_limit_keeps_the_run_as_it_was(sandbox, trained):
    copy_trained(trained, sandbox)
    before = records(sandbox)
    result = train(sandbox, "--train.max_steps=12", file_size_limit=1024)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.code == 2 and len(result.errors) == 1, result.stderr
    assert "config.step_10.toml (File too large)" in result.errors[0]
    assert records(sandbox) == before  # no temporary, no torn file, metrics untouched
    assert os.readlink(sandbox.ckpt / "latest") == "step_10"


def test_metrics_on_a_full_disk_stop_the_run_with_a_checkpoint_and_it_resumes(sandbox):
    sandbox.dir.mkdir()
    (sandbox.dir / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    result = train_here(sandbox)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.code == 75, result.stderr  # stopped as for a preemption: run again
    assert len(result.errors) == 1, result.stderr
    assert "metrics.jsonl: cannot write" in result.errors[0]
    assert "(No space left on device)" in result.errors[0]
    stopped = int(os.readlink(sandbox.ckpt / "latest").removeprefix("step_"))
    assert 1 <= stopped < 12  # stopped early, its work saved
    (sandbox.dir / "metrics.jsonl").unlink()  # the disk has room again
    resumed = train_here(sandbox)
    assert resumed.code == 0, resumed.stderr
    assert steps_logged(sandbox) == list(range(stopped + 1, 13))
