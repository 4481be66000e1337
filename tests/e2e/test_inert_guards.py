"""Each guard made inert (a mutant of its mechanism) fails the start's check: refused by name,
exit 2, nothing written. The same start with the mechanism intact says the guard is armed."""

from __future__ import annotations

import json

import pytest
import torch

from forge.model.transformer import TransformerBlock
from forge.resilience.signals import ShutdownFlag
from forge.training.loop import plan
from forge.training.setup import guards
from forge.training.steps import spec
from tests.e2e.sandbox import make_run, train_here


def no_snapshots(monkeypatch):
    monkeypatch.setattr(plan.LoopPolicy, "snapshots", property(lambda self: False))


def spikes_not_dropped(monkeypatch):
    monkeypatch.setattr(plan.LoopPolicy, "drops_spikes", property(lambda self: False))


class ReplaysNothing:
    """The step's replay rule whatever the config asks: none."""

    @staticmethod
    def configured(config):
        return plan.ReplayRule()


def no_replays(monkeypatch):
    monkeypatch.setattr(spec, "ReplayRule", ReplaysNothing)


def signals_not_installed(monkeypatch):
    monkeypatch.setattr(ShutdownFlag, "install", lambda self: self)


# (guard, its config, the mutant that makes it inert, the key refused, the armed words)
MUTANTS = [
    ("rollback", ["--resilience.on_nonfinite=rollback"], no_snapshots, "resilience.on_nonfinite", "nonfinite=rollback"),
    ("spikes", ["--resilience.spike_threshold=6", "--resilience.on_spike=skip"], spikes_not_dropped, "resilience.spike_threshold", "spikes=skip(6σ)"),
    ("replays", ["--resilience.replay_interval=4"], no_replays, "resilience.replay_interval", "replay every 4 + first step"),
    ("signals", [], signals_not_installed, "resilience.shutdown_timeout_s", "signals"),
]  # fmt: skip


@pytest.mark.parametrize(
    "args,mutant,key,words", [m[1:] for m in MUTANTS], ids=[m[0] for m in MUTANTS]
)
def test_a_guard_made_inert_is_refused_at_start(sandbox, monkeypatch, args, mutant, key, words):
    mutant(monkeypatch)
    result = train_here(sandbox, *args)
    assert result.code == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert [e.split(":")[1].strip() for e in result.errors] == [key], result.stderr
    assert not sandbox.dir.exists() or not (sandbox.dir / "config.toml").exists()


@pytest.mark.parametrize("args,words", [(m[1], m[4]) for m in MUTANTS], ids=[m[0] for m in MUTANTS])
def test_an_intact_guard_is_armed_and_said_once(sandbox, args, words):
    # 11 steps: the spike rule judges step 11 first (its warm-up); a shorter run is refused
    result = train_here(sandbox, *args, "--train.max_steps=11", "--scheduler.warmup_steps=1")
    assert result.code == 0, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith("[forge] guards: ")]
    assert len(lines) == 1 and words in lines[0], result.stderr


def kernels_checked(monkeypatch):
    """The start's kernel probe on, as on CUDA (``checks_kernels``)."""
    monkeypatch.setattr(guards, "checks_kernels", lambda device: True)


def put_in_every_block(monkeypatch):
    """Every transformer block also runs ``put_``, which torch names as having no
    deterministic kernel on any device (as ``index_add_`` on CUDA)."""
    forward = TransformerBlock.forward

    def with_put(self, *args, **kwargs):
        torch.zeros(2).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TransformerBlock, "forward", with_put)


def test_a_replay_of_a_step_without_deterministic_kernels_is_refused_at_start(sandbox, monkeypatch):
    """The probe runs the first step's computation once before anything is written: an
    operation without a deterministic kernel is named there, not at the first replayed
    step after the run dir is claimed."""
    kernels_checked(monkeypatch)
    put_in_every_block(monkeypatch)
    result = train_here(sandbox)
    assert result.code == 2, result.stderr
    assert "Traceback" not in result.stderr
    (error,) = result.errors
    assert error.startswith("error: resilience.replay_first_step: ") and "runs put_" in error
    assert not sandbox.dir.exists() or not (sandbox.dir / "config.toml").exists()
    off = train_here(
        sandbox, "--resilience.replay_first_step=false", "--train.max_steps=2",
        "--scheduler.warmup_steps=1",
    )  # fmt: skip
    assert off.code == 0, off.stderr  # without replays the operation is no guard's concern


def test_a_probed_start_trains_exactly_as_an_unprobed_one(tmp_path, small_corpus, monkeypatch):
    """The probe's computation leaves no gradient and no loader position behind: every
    step's loss and grad norm equal a start without it (replays every 3 steps, the first
    not replayed: nothing of the probe is washed out by a replay's reset)."""
    args = (
        "--train.max_steps=4", "--scheduler.warmup_steps=1",
        "--resilience.replay_interval=3", "--resilience.replay_first_step=false",
    )  # fmt: skip
    for name in ("plain", "probed"):
        (tmp_path / name).mkdir()
    plain = make_run(tmp_path / "plain", small_corpus)
    assert train_here(plain, *args).code == 0
    kernels_checked(monkeypatch)
    probed = make_run(tmp_path / "probed", small_corpus)
    result = train_here(probed, *args)
    assert result.code == 0, result.stderr
    assert "replay every 3" in result.stderr
    assert losses(probed) == losses(plain) and len(losses(plain)) == 4


def losses(run) -> list[tuple[int, float, float]]:
    rows = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


# (a key that only acts among several ranks, set at one process): refused by its own name
ONE_PROCESS = [
    "--resilience.straggler_logs=9",
    "--resilience.health_timeout_s=30",
    "--resilience.health_check_interval=10",
]


@pytest.mark.parametrize("arg", ONE_PROCESS)
def test_a_key_of_several_ranks_set_at_one_process_is_refused_by_name(sandbox, arg):
    result = train_here(sandbox, arg)
    assert result.code == 2, result.stderr
    key = arg.removeprefix("--").split("=")[0]
    assert [e.split(":")[1].strip() for e in result.errors] == [key], result.stderr
    assert not sandbox.dir.exists() or not (sandbox.dir / "config.toml").exists()


# (a guard whose first action comes after the run's last step): refused by name
TOO_SHORT = [
    ("spikes", ["--resilience.spike_threshold=6", "--train.max_steps=8"], "resilience.spike_threshold"),
    ("replays", ["--resilience.replay_interval=9", "--resilience.replay_first_step=false", "--train.max_steps=8"], "resilience.replay_interval"),
]  # fmt: skip


@pytest.mark.parametrize("args,key", [r[1:] for r in TOO_SHORT], ids=[r[0] for r in TOO_SHORT])
def test_a_guard_that_could_not_act_before_the_run_ends_is_refused(sandbox, args, key):
    result = train_here(sandbox, *args, "--scheduler.warmup_steps=1")
    assert result.code == 2, result.stderr
    assert [e.split(":")[1].strip() for e in result.errors] == [key], result.stderr
    assert "train.max_steps" in result.errors[0]
