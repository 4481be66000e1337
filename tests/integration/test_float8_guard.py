"""The FP8 drift guard (``train.float8_check``): its pure decisions as tables, and whole runs
of the tiny config (one rank, in this process, torchao's emulation, every second step
checked) with a scale fault injected into torchao's scaling from step 20 on (every FP8 cast's
scale 4096 times too large: the casts saturate), under each ``train.float8_on_drift``: the
guard stays quiet through the 20 clean steps with its default tolerances and catches the
fault at the first check after it.

Measured with this fault (every step checked): steps 1–20 drift by at most 0.02% (loss) and
0.3% (gradient norm); steps 21–24 by 14–15% and 82–93%. A clean run of 200 steps (rowwise):
at most 0.5% and 19% (docs/precision.md).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from forge.config.train import FLOAT8_OFF
from forge.training.loop.finalize import CheckpointView, FinalSaveReason, finalize
from forge.training.loop.outcome import exit_code
from forge.training.steps.float8_check import Float8CheckRule, float8_verdict, relative_drift
from forge.types import ExitCode, Float8Drift, Hooks, LoopOutcome
from tests.distributed.test_equivalence import COMMON, TRAIN, write_config
from tests.in_process import run_main

torchao = pytest.importorskip("torchao")  # the fp8 extra, in dev: runs in `make test`

INF = math.inf


@pytest.mark.parametrize(
    ("value", "reference", "drift"),
    [(1.0, 1.0, 0.0), (1.1, 1.0, 0.1), (0.9, 1.0, 0.1), (0.0, 0.0, 0.0), (1.0, 0.0, INF),
     (math.nan, 1.0, INF), (INF, 1.0, INF),
     # the step fails in high precision too: no drift (the non-finite policy's step)
     (1.0, INF, 0.0), (math.nan, math.nan, 0.0), (INF, -INF, 0.0)],
)  # fmt: skip
def test_relative_drift(value, reference, drift):
    assert relative_drift(value, reference) == pytest.approx(drift)


@pytest.mark.parametrize(
    ("loss", "norm", "on_drift", "action"),
    [(0.01, 0.4, Float8Drift.STOP, None), (0.06, 0.0, Float8Drift.WARN, Float8Drift.WARN),
     (0.0, 0.6, Float8Drift.FALLBACK, Float8Drift.FALLBACK), (INF, 0.0, Float8Drift.STOP,
     Float8Drift.STOP), (0.05, 0.5, Float8Drift.STOP, None), (0.0, math.nan,
     Float8Drift.WARN, Float8Drift.WARN)],
)  # fmt: skip
def test_a_drift_past_the_tolerance_takes_the_configured_action(loss, norm, on_drift, action):
    verdict = float8_verdict(loss, norm, Float8CheckRule(2, 0.05, 0.5, on_drift))
    assert verdict.action is action and verdict.stops is (action is Float8Drift.STOP)


@pytest.mark.parametrize(("interval", "step", "checked"), [(0, 4, False), (2, 4, True),
                                                           (2, 3, False), (1, 1, True)])  # fmt: skip
def test_which_steps_are_checked(interval, step, checked):
    assert Float8CheckRule(interval).checks(step) is checked


def test_a_drift_stop_ends_the_run_with_its_own_code_and_no_final_save():
    assert exit_code(LoopOutcome.FLOAT8_DRIFT) == ExitCode.FLOAT8_DRIFT == 7
    final = finalize(LoopOutcome.FLOAT8_DRIFT, CheckpointView(step=4, max_steps=8,
                                                              last_saved_step=2))  # fmt: skip
    assert not final.save and final.reason is FinalSaveReason.FAILURE


FAULT_FROM = 20  # the fault starts after this step


class ScaleFault(Hooks):
    """Every FP8 cast's scale 4096 times too large once step ``FAULT_FROM`` is done (the
    casts saturate); counts the casts made after it."""

    def __init__(self) -> None:
        self.active = False
        self.casts_after = 0

    def on_step_end(self, state, result) -> None:
        self.active = state.step >= FAULT_FROM


@pytest.fixture
def scale_fault(monkeypatch):
    from torchao.float8 import float8_scaling_utils

    real = float8_scaling_utils.tensor_to_scale
    fault = ScaleFault()

    def faulty(*args, **kwargs):
        if not fault.active:
            return real(*args, **kwargs)
        fault.casts_after += 1
        return real(*args, **kwargs) * 4096

    monkeypatch.setattr(float8_scaling_utils, "tensor_to_scale", faulty)
    return fault


def run(tmp_path, corpus, fault, *args, hooks=()):
    config = write_config(tmp_path, corpus)
    out = run_main(TRAIN.main, [str(config), f"--run.dir={tmp_path / 'run'}", *COMMON,
                                "--train.max_steps=24", "--scheduler.decay_steps=24",
                                "--checkpoint.interval=1", "--checkpoint.keep_last_n=2",
                                "--eval.interval=24", "--metrics.log_interval=1",
                                "--train.float8=tensorwise", "--train.float8_check=2", *args],
                   hooks=[fault, *hooks])  # fmt: skip
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return out, [json.loads(line) for line in lines if '"loss"' in line]


def drifted_steps(stderr: str) -> list[int]:
    return [int(line.split("step ")[1].split()[0]) for line in stderr.splitlines()
            if "in FP8 drifted" in line]  # fmt: skip


def test_warn_stays_quiet_while_clean_then_names_each_drifted_step_and_trains_on(
    tmp_path, small_corpus, scale_fault
):
    out, records = run(tmp_path, small_corpus, scale_fault)
    assert out.returncode == 0, out.stderr[-2000:]
    assert drifted_steps(out.stderr) == [22, 24]
    checked = {r["step"]: r for r in records if "float8/loss_drift" in r}
    assert sorted(checked) == list(range(2, 25, 2))
    assert all(checked[s]["float8/loss_drift"] < 0.05 for s in range(2, 21, 2))
    assert all(checked[s]["float8/loss_drift"] > 0.05 for s in (22, 24))


def test_fallback_computes_in_high_precision_for_the_rest_of_the_launch(
    tmp_path, small_corpus, scale_fault
):
    out, records = run(tmp_path, small_corpus, scale_fault, "--train.float8_on_drift=fallback")
    assert out.returncode == 0, out.stderr[-2000:]
    assert drifted_steps(out.stderr) == [22] and "its resumes too" in out.stderr
    assert [r["step"] for r in records if "float8/loss_drift" in r][-1] == 22  # checks stop
    assert [r["step"] for r in records] == list(range(1, 25))
    casts = scale_fault.casts_after
    assert casts > 0  # steps 21 and 22 cast; 23, 24 and the evaluation cast nothing:
    fp8_step = casts // 2  # step 21's casts (step 22's FP8 computation casts as many)
    assert casts == 2 * fp8_step


def test_a_run_stopped_after_its_fallback_resumes_in_high_precision_as_if_never_stopped(
    tmp_path, small_corpus, scale_fault
):
    """The fallback is the run's, not one launch's: a resume (a requeue, the same command)
    computes in high precision from its first step and ends with the weights of the run
    never stopped; in FP8 again, its step 24 was another computation."""
    from tests.distributed.test_equivalence import weights
    from tests.e2e.test_train_script import SignalAt

    fallback = "--train.float8_on_drift=fallback"
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    for folder in (whole, stopped):
        folder.mkdir()
    assert run(whole, small_corpus, scale_fault, fallback)[0].returncode == 0
    scale_fault.active = False  # each launch starts clean; the fault begins after step 20
    out, _ = run(stopped, small_corpus, scale_fault, fallback, hooks=[SignalAt(22)])
    assert out.returncode == ExitCode.SHUTDOWN, out.stderr[-2000:]
    scale_fault.active = False
    out, records = run(stopped, small_corpus, scale_fault, fallback)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "FP8 fell back to high precision at step 22" in out.stderr
    assert not [r for r in records if r["step"] > 22 and "float8/loss_drift" in r]  # no checks
    config = whole / "tiny.toml"
    reference = weights(config, whole / "run", 24)
    for name, tensor in weights(config, stopped / "run", 24).items():
        assert torch.equal(tensor, reference[name]), name


def test_stop_applies_nothing_and_ends_the_run_with_exit_7(tmp_path, small_corpus, scale_fault):
    out, _ = run(tmp_path, small_corpus, scale_fault, "--train.float8_on_drift=stop")
    assert out.returncode == ExitCode.FLOAT8_DRIFT, out.stderr[-2000:]
    assert drifted_steps(out.stderr) == [22] and "error: step 22 in FP8 drifted" in out.stderr
    assert f"resume from the last checkpoint with {FLOAT8_OFF}" in out.stdout + out.stderr
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == ["step_20", "step_21"]  # step 22 was not applied, no final save followed
