"""Non-finite steps end to end in one process: skip and rollback, with the files on disk."""

from __future__ import annotations

import json
import math

import pytest

from forge.config import load_config
from forge.optim import lr_at, resolve_schedule
from tests.e2e.test_train_script import TRAIN, latest, reference_config, run_dir


def records(config):
    lines = (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def train_state(config, step):
    return json.loads(
        (run_dir(config) / "checkpoints" / f"step_{step}" / "train_state.json").read_text()
    )


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if "was not finite" in line]


def test_skipped_step_keeps_the_documented_bookkeeping(tiny_config, monkeypatch, capsys):
    """NaN at step 5 (a checkpoint step): the update is dropped, in one line and a count;
    step, LR, tokens and data position advance; the checkpoint gate still saves step 5."""
    monkeypatch.setenv("FORGE_FAULTS", "nan:step=5")
    assert TRAIN.main([str(tiny_config)]) == 0
    assert warnings_of(capsys.readouterr().err) == [
        "[forge] warning: step 5 was not finite (loss or gradient norm) on some rank: its "
        'update was dropped (resilience.on_nonfinite = "skip")'
    ]
    recs = records(tiny_config)
    assert [r.get("resilience/nonfinite_steps", 0) for r in recs] == [0] * 4 + [1] * 8
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert math.isnan(recs[4]["loss"])
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(recs) if i != 4)
    cfg = load_config([str(tiny_config)]).config
    schedule = resolve_schedule(cfg.scheduler, cfg.train.max_steps)
    assert [r["lr"] for r in recs] == [lr_at(schedule, cfg.optimizer.lr, k) for k in range(12)]
    tokens = cfg.train.batch_size * cfg.train.seq_len
    assert [r["tokens_seen"] for r in recs] == [tokens * k for k in range(1, 13)]
    saved = train_state(tiny_config, 5)
    assert saved["loop_state"]["last_step_finite"] is False
    assert position(saved["loader"]) == loader_after(cfg, steps=5)
    assert position(train_state(tiny_config, 12)["loader"]) == loader_after(cfg, steps=12)


def position(loader: dict) -> dict:
    """A saved loader position without its digest (compared elsewhere)."""
    return {k: v for k, v in loader.items() if k != "digest"}


def loader_after(cfg, steps):
    """The saved loader position after ``steps`` optimizer steps' worth of rows (one source;
    the digest is whatever those rows hash to, compared elsewhere)."""
    rows = steps * cfg.train.grad_accum_steps * cfg.train.batch_size
    return {"rows": rows, "steps": steps, "step_rows": 0, "cursors": [rows]}


def test_rollback_restores_the_slot_skips_the_window_and_finishes(tiny_config, monkeypatch, capsys):
    """NaN at step 8 with snapshots every 3 steps: back to step 6, batches 7-8 skipped."""
    monkeypatch.setenv("FORGE_FAULTS", "nan:step=8")
    args = [
        str(tiny_config),
        "--resilience.on_nonfinite=rollback",
        "--resilience.snapshot_interval=3",
    ]
    assert TRAIN.main(args) == 0
    (line,) = warnings_of(capsys.readouterr().err)  # named by its own number, not the snapshot's
    assert line.startswith("[forge] warning: step 8 was not finite") and "rollback" in line
    assert records(tiny_config)[-1]["resilience/nonfinite_steps"] == 1
    steps = [r["step"] for r in records(tiny_config)]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9, 10, 11, 12]
    losses = {i: r["loss"] for i, r in enumerate(records(tiny_config))}
    assert math.isnan(losses[7]) and all(math.isfinite(v) for k, v in losses.items() if k != 7)
    final = train_state(tiny_config, 12)
    assert latest(tiny_config) == "step_12"
    assert final["loop_state"]["skipped_ranges"] == [[7, 8]]
    # the data position counts every batch consumed, the skipped window included
    cfg = load_config([str(tiny_config)]).config
    assert position(final["loader"]) == loader_after(cfg, steps=14)
    # the first step after the rollback runs at step 7's LR, on new data
    recs = records(tiny_config)
    assert recs[8]["lr"] == recs[6]["lr"] and recs[8]["loss"] != recs[6]["loss"]


def test_consecutive_nonfinite_steps_abort_without_a_final_save(tiny_config, monkeypatch):
    monkeypatch.setenv("FORGE_FAULTS", "nan:step=7,nan:step=8")
    args = [str(tiny_config), "--resilience.max_consecutive_nonfinite=2"]
    assert TRAIN.main(args) == 3
    assert latest(tiny_config) == "step_5"


@pytest.mark.parametrize(
    "policy,code,steps",
    [
        # rolled back to step 4 each time: 5, 6, 5, 6, 5, 6, then the limit ends it
        ("rollback", 3, [1, 2, 3, 4, 5, 6, 5, 6, 5, 6]),
        # the step counter moves on: step 6 is skipped once, the other five faults never fire
        ("skip", 0, list(range(1, 13))),
    ],
)
def test_a_step_that_fails_each_time_it_recurs_is_bounded(
    tiny_config, monkeypatch, capsys, policy, code, steps
):
    """A NaN at step 6 every time the run gets there (six times), max 3 in a row: rollback
    ends the run NAN_ABORT naming step 6 instead of rolling back forever; skip moves on."""
    monkeypatch.setenv("FORGE_FAULTS", ",".join(["nan:step=6"] * 6))
    args = [
        str(tiny_config),
        f"--resilience.on_nonfinite={policy}",
        "--resilience.snapshot_interval=4",
        "--resilience.max_consecutive_nonfinite=3",
        "--metrics.log_interval=1",
    ]
    assert TRAIN.main(args) == code
    assert [r["step"] for r in records(tiny_config)] == steps
    captured = capsys.readouterr()
    if code:
        assert "without an applied step past step 6, failing again each time" in captured.out
        assert captured.err.count("rolled back to step 4") == 2


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_resume_after_a_recovered_nan_is_exact(tiny_config, tmp_path, monkeypatch, policy):
    """A run that recovered from a NaN, stopped and resumed, equals the same run uninterrupted."""
    from tests.e2e.test_train_script import SignalAt, losses

    reference = reference_config(tiny_config, tmp_path)
    monkeypatch.setenv("FORGE_FAULTS", "nan:step=4")
    args = [f"--resilience.on_nonfinite={policy}", "--resilience.snapshot_interval=2"]
    assert TRAIN.main([str(reference), *args]) == 0
    assert TRAIN.main([str(tiny_config), *args], hooks=[SignalAt(6)]) == 75
    monkeypatch.delenv("FORGE_FAULTS")
    assert TRAIN.main([str(tiny_config), *args]) == 0
    assert str(losses(tiny_config)) == str(losses(reference))  # str: NaN == NaN


def test_shutdown_poll_still_runs_on_a_skipped_step(tiny_config, monkeypatch):
    """SIGTERM after step 4, NaN at step 5: the skipped step 5 still stops the run and saves."""
    monkeypatch.setenv("FORGE_FAULTS", "signal:step=4,nan:step=5")
    assert TRAIN.main([str(tiny_config), "--checkpoint.interval=100"]) == 75
    assert latest(tiny_config) == "step_5"
    assert train_state(tiny_config, 5)["reason"] == "emergency"


def test_a_signal_during_start_up_is_not_lost(tiny_config):
    import os
    import signal

    from forge.training.loop.hooks import Hooks

    class SignalAtStart(Hooks):
        def on_train_begin(self, state):
            os.kill(os.getpid(), signal.SIGTERM)

    assert TRAIN.main([str(tiny_config)], hooks=[SignalAtStart()]) == 75
    assert latest(tiny_config) == "step_1"


def test_shutdown_timeout_forces_exit():
    """A process that does not finish within shutdown_timeout_s of the signal exits 75."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from forge.resilience.signals import ShutdownFlag\n"
        "ShutdownFlag(timeout_s=0.5).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"  # a stuck save
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=False
    )
    assert out.returncode == 75
    assert "did not finish within 0.5 s" in out.stderr


SPIKE = ["--train.max_steps=20", "--resilience.spike_threshold=6", "--resilience.on_spike=skip"]


def test_a_skipped_spike_continues_exactly_as_a_skipped_nan(tiny_config, tmp_path, monkeypatch):
    """A finite spike x1000 at step 15 under on_spike=skip: dropped as a NaN at step 15 is
    under on_nonfinite=skip, so steps 16-20 are bit-identical; the spike is counted."""
    nan_run = reference_config(tiny_config, tmp_path)
    monkeypatch.setenv("FORGE_FAULTS", "nan:step=15")
    assert TRAIN.main([str(nan_run), "--train.max_steps=20"]) == 0
    monkeypatch.setenv("FORGE_FAULTS", "spike:step=15:scale=1000")
    assert TRAIN.main([str(tiny_config), *SPIKE]) == 0
    spiked, skipped = records(tiny_config), records(nan_run)
    assert [r["loss"] for r in spiked[15:]] == [r["loss"] for r in skipped[15:]]
    assert [r["loss"] for r in spiked[:14]] == [r["loss"] for r in skipped[:14]]
    assert spiked[14]["loss"] > 1000 * spiked[13]["loss"] / 2 and math.isnan(skipped[14]["loss"])
    assert [r["resilience/spikes"] for r in spiked] == [0] * 14 + [1] * 6
    assert train_state(tiny_config, 20)["loop_state"]["spikes"] == 1


def test_a_resume_across_a_spike_is_exact(tiny_config, tmp_path, monkeypatch):
    """Stopped at step 14, resumed: the spike at step 15 is measured against the statistics
    the checkpoint kept (a resume that lost them would not see it before its warm-up)."""
    from tests.e2e.test_train_script import SignalAt, losses

    reference = reference_config(tiny_config, tmp_path)
    monkeypatch.setenv("FORGE_FAULTS", "spike:step=15:scale=1000")
    assert TRAIN.main([str(reference), *SPIKE]) == 0
    assert TRAIN.main([str(tiny_config), *SPIKE], hooks=[SignalAt(13)]) == 75
    assert train_state(tiny_config, 14)["loop_state"]["loss_stats"]["count"] == 14
    assert TRAIN.main([str(tiny_config), *SPIKE]) == 0
    assert losses(tiny_config) == losses(reference)
    assert records(tiny_config)[-1]["resilience/spikes"] == 1


def test_a_spike_under_rollback_restores_the_snapshot_and_skips_the_window(
    tiny_config, monkeypatch
):
    """A spike at step 14 with snapshots every 3 steps: back to step 12, batches 13-14 skipped,
    as a NaN would be under on_nonfinite=rollback."""
    monkeypatch.setenv("FORGE_FAULTS", "spike:step=14:scale=1000")
    args = [
        str(tiny_config),
        "--train.max_steps=16",
        "--resilience.spike_threshold=6",
        "--resilience.on_spike=rollback",
        "--resilience.snapshot_interval=3",
    ]
    assert TRAIN.main(args) == 0
    steps = [r["step"] for r in records(tiny_config)]
    assert steps == [*range(1, 15), 13, 14, 15, 16]
    assert train_state(tiny_config, 16)["loop_state"]["skipped_ranges"] == [[13, 14]]
    assert records(tiny_config)[-1]["resilience/spikes"] == 1
