"""A run directory's records beside its checkpoints: the config history a resume with changes
keeps (``config.toml`` never overwritten), and a disk that cannot take them: a full disk or a
file-size limit while writing ``config.toml`` or ``metrics.jsonl`` stops the run cleanly,
with its work saved and nothing half-written."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from forge.training.records.run_dir import load_run_config
from forge.training.records.run_records import recorded_configs
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


def test_every_commit_is_recorded_in_the_run(trained):
    lines = (trained.dir / "checkpoints.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [5, 10]


# (case, what is removed of the trained run's checkpoints, the newest left, its words)
LOST = [
    ("every checkpoint deleted", ["step_5", "step_10", "latest"], None, "none is left"),
    ("the newest deleted", ["step_10"], 5, "the newest committed one is step_5"),
]


@pytest.mark.parametrize("removed,newest,words", [r[1:] for r in LOST], ids=[r[0] for r in LOST])
def test_records_past_the_newest_checkpoint_are_refused_and_kept(
    sandbox, trained, removed, newest, words
):
    """The run's records say step 10 was committed, its checkpoints say less: a start would
    train steps it has records of (and used to cut ``metrics.jsonl`` back to them)."""
    copy_trained(trained, sandbox)
    for name in removed:
        path = sandbox.ckpt / name
        path.unlink() if path.is_symlink() else shutil.rmtree(path)
    before = records(sandbox)
    result = train_here(sandbox, "--train.max_steps=12")
    assert result.code == 2, result.stderr
    assert len(result.errors) == 1, result.stderr
    assert "records a committed checkpoint of step 10 (checkpoints.jsonl)" in result.errors[0]
    assert words in result.errors[0] and "--checkpoint.allow_rewind=true" in result.errors[0]
    assert records(sandbox) == before  # nothing written, nothing cut
    # going back on purpose: the records past the start are kept aside, not lost
    again = train_here(sandbox, "--train.max_steps=12", "--checkpoint.allow_rewind=true")
    assert again.code == 0, again.stderr
    start = newest or 0
    superseded = (sandbox.dir / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in superseded if "loss" in x] == list(range(start + 1, 11))
    assert steps_logged(sandbox) == list(range(1, 13))
    commits = [json.loads(x) for x in (sandbox.dir / "checkpoints.jsonl").read_text().splitlines()]
    assert commits[2] | {"time": 0} == {"step": start, "rewound_from": 10, "time": 0}
    # the next start finds records and checkpoints agreeing again
    assert train_here(sandbox, "--train.max_steps=12").code == 0


# (case, what is in the way, the refusal's words)
IN_THE_WAY = [
    ("a file at the final save's step path", "step_12", "step_12: not a checkpoint folder, and in the way of this run's save"),
    ("a folder at latest", "latest/", "latest: a folder where each commit of this run writes its link"),
]  # fmt: skip


@pytest.mark.parametrize("entry,words", [w[1:] for w in IN_THE_WAY], ids=[w[0] for w in IN_THE_WAY])
def test_a_path_a_save_needs_is_refused_before_training(sandbox, entry, words):
    """A file at ``checkpoints/step_12`` (the final save's path) used to read as an incomplete
    checkpoint, a folder at ``latest`` as no link: steps trained, then a save failed, at every
    launch."""
    sandbox.ckpt.mkdir(parents=True)
    if entry.endswith("/"):
        (sandbox.ckpt / entry).mkdir()
    else:
        (sandbox.ckpt / entry).write_text("notes\n")
    result = train_here(sandbox)
    assert result.code == 2, result.stderr
    assert len(result.errors) == 1, result.stderr
    assert words in result.errors[0]
    assert not (sandbox.dir / "metrics.jsonl").exists()


def test_a_run_launched_with_relative_paths_is_read_from_any_folder(sandbox, monkeypatch):
    """``config.toml`` records the local paths absolute, against the launch's folder: a reader
    started in another folder finds the run's data and checkpoints (it looked for them beside
    itself, and said to prepare the data there)."""
    from tests.e2e.test_train_script import load_script
    from tests.in_process import run_main

    monkeypatch.chdir(sandbox.root)
    relative = ["--data.path=data", "--checkpoint.dir=ckpts", "--train.max_steps=3"]
    result = train_here(sandbox, *relative)
    assert result.code == 0, result.stderr
    recorded = load_run_config(sandbox.dir)
    assert recorded.data.path == str(sandbox.root / "data")
    assert recorded.checkpoint.dir == str(sandbox.root / "ckpts")
    elsewhere = sandbox.root / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = run_main(load_script("eval").main, [str(sandbox.dir)])
    assert out.returncode == 0, out.stderr
    assert f"{sandbox.root / 'ckpts' / 'step_3'}" in out.stdout
    monkeypatch.chdir(sandbox.root)  # the same launch again: its record stands as it was
    assert train_here(sandbox, *relative).code == 0
    assert sorted(recorded_configs(sandbox.dir)) == [0]


def test_a_resume_after_config_toml_was_deleted_says_so_and_records_its_own_as_a_change(
    sandbox, trained
):
    """Not written as ``config.toml``, which would claim the resumed config trained steps
    1-10 too."""
    copy_trained(trained, sandbox)
    (sandbox.dir / "config.toml").unlink()
    result = train_here(sandbox, "--train.max_steps=12")
    assert result.code == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "config.toml is gone" in line]
    assert len(said) == 1 and "steps 1-10 is recorded nowhere" in said[0], result.stderr
    assert sorted(recorded_configs(sandbox.dir)) == [10]  # no config.toml written
    assert load_run_config(sandbox.dir).train.max_steps == 12
