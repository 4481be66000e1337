"""A resume with a changed config: each kind of change named, key by key with old → new
values, and its way forward taken end to end (``forge/training/config_changes.py``)."""

from __future__ import annotations

import json

import pytest

from forge.config import load_config
from forge.optim import lr_at, resolve_schedule
from tests.e2e.test_train_script import (
    TRAIN,
    SignalAt,
    latest,
    losses,
    reference_config,
    run_dir,
)


def records(config):
    lines = (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture
def stopped(tiny_config):
    """The tiny run stopped by SIGTERM after step 6 (emergency checkpoint step_7)."""
    assert TRAIN.main([str(tiny_config)], hooks=[SignalAt(6)]) == 75
    assert latest(tiny_config) == "step_7"
    return tiny_config


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_another_optimizer_is_refused_naming_it_never_as_damage(stopped, capsys):
    before = sorted(p.name for p in (run_dir(stopped) / "checkpoints").iterdir())
    capsys.readouterr()
    assert TRAIN.main([str(stopped), "--optimizer.name=lion"]) == 2
    (line,) = error_lines(capsys)
    assert "optimizer.name: 'adamw' → 'lion'" in line
    assert 'checkpoint.exclude_from_loading=["optimizer"]' in line
    assert "broken" not in line and "loads" not in line
    assert sorted(p.name for p in (run_dir(stopped) / "checkpoints").iterdir()) == before


def test_a_fresh_optimizer_switches_adamw_to_lion_without_a_loss_jump(stopped, capsys):
    args = [
        "--optimizer.name=lion",
        "--optimizer.lr=3e-4",
        '--checkpoint.exclude_from_loading=["optimizer"]',
    ]
    capsys.readouterr()
    assert TRAIN.main([str(stopped), *args, "--checkpoint.schedule_from=config"]) == 0
    assert "with a fresh optimizer" in capsys.readouterr().err
    by_step = {r["step"]: r["loss"] for r in records(stopped)}
    assert sorted(by_step) == list(range(1, 13))
    assert by_step[8] < by_step[7] + 0.5  # AdamW's moments in Lion: 5.1 -> 11.4


def test_another_schedule_is_refused_naming_every_changed_key(stopped, capsys):
    capsys.readouterr()
    assert TRAIN.main([str(stopped), "--scheduler.name=wsd", "--optimizer.lr=0.5"]) == 2
    (line,) = error_lines(capsys)
    assert "optimizer.lr: 0.003 → 0.5" in line and "scheduler.name: 'cosine' → 'wsd'" in line
    assert 'checkpoint.schedule_from="checkpoint"' in line and "from step 7" in line


def test_schedule_from_checkpoint_resumes_the_run_that_was_never_changed(stopped, tmp_path):
    reference = reference_config(stopped, tmp_path)
    assert TRAIN.main([str(reference)]) == 0
    changed = [
        "--scheduler.name=wsd",
        "--optimizer.lr=0.5",
        "--checkpoint.schedule_from=checkpoint",
    ]
    assert TRAIN.main([str(stopped), *changed]) == 0
    assert losses(stopped) == losses(reference)  # bit for bit: the recorded schedule ran


def test_schedule_from_config_follows_the_new_schedule_from_the_resume_step(stopped):
    changed = ["--optimizer.lr=1e-3", "--checkpoint.schedule_from=config"]
    assert TRAIN.main([str(stopped), *changed]) == 0
    cfg = load_config([str(stopped), *changed]).config
    schedule = resolve_schedule(cfg.scheduler, cfg.train.max_steps)
    lrs = {r["step"]: r["lr"] for r in records(stopped)}
    assert all(lrs[k] == lr_at(schedule, 1e-3, k - 1) for k in range(8, 13))
    assert lrs[7] != lr_at(schedule, 1e-3, 6)  # the steps before ran the old schedule


def test_raising_max_steps_of_a_decaying_schedule_names_the_decay(tiny_config, capsys):
    assert TRAIN.main([str(tiny_config)]) == 0
    capsys.readouterr()
    assert TRAIN.main([str(tiny_config), "--train.max_steps=14"]) == 2
    (line,) = error_lines(capsys)
    assert "decay steps (scheduler.decay_steps or train.max_steps): 10 → 12" in line
    assert (
        TRAIN.main(
            [str(tiny_config), "--train.max_steps=14", "--checkpoint.schedule_from=checkpoint"]
        )
        == 0
    )
    lrs = {r["step"]: r["lr"] for r in records(tiny_config)}
    assert lrs[13] == lrs[14] == pytest.approx(3e-3 * 0.1)  # past the recorded decay: the floor


@pytest.mark.parametrize(
    ("change", "warned"),
    [
        ("--train.grad_clip_norm=5.0", "train.grad_clip_norm: 1.0 → 5.0"),
        ("--model.attention=sdpa", "model.attention: 'auto' → 'sdpa'"),
        ("--metrics.log_interval=2", None),
        ("--eval.interval=3", None),
        ("--checkpoint.interval=3", None),
    ],
    ids=[
        "numerics: a warning",
        "attention kernel: a warning",
        "logging: free",
        "evaluation: free",
        "checkpointing: free",
    ],
)
def test_numerics_are_warned_about_and_the_free_keys_pass_silently(stopped, capsys, change, warned):
    capsys.readouterr()
    assert TRAIN.main([str(stopped), change]) == 0
    err = capsys.readouterr().err
    if warned is None:
        assert "warning" not in err, err
    else:
        assert "other training numerics" in err and warned in err


def test_a_resume_over_a_metrics_file_with_damaged_bytes_drops_that_line(stopped, capsys):
    path = run_dir(stopped) / "metrics.jsonl"
    path.write_bytes(path.read_bytes() + b'{"step": 99, \xff\xfe}\n')
    capsys.readouterr()
    assert TRAIN.main([str(stopped)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert [r["step"] for r in records(stopped)] == list(range(1, 13))
