"""Each guard made inert (a mutant of its mechanism) fails the start's check: refused by name,
exit 2, nothing written. The same start with the mechanism intact says the guard is armed."""

from __future__ import annotations

import pytest

from forge.resilience.signals import ShutdownFlag
from forge.training.loop import plan
from forge.training.steps import spec
from tests.e2e.sandbox import train_here


def no_snapshots(monkeypatch):
    monkeypatch.setattr(plan.LoopPolicy, "snapshots", property(lambda self: False))


def spikes_not_dropped(monkeypatch):
    monkeypatch.setattr(plan.LoopPolicy, "drops_spikes", property(lambda self: False))


def no_replays(monkeypatch):
    monkeypatch.setattr(spec, "ReplayRule", lambda *args: plan.ReplayRule())


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
    result = train_here(sandbox, *args, "--train.max_steps=6", "--scheduler.warmup_steps=1")
    assert result.code == 0, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith("[forge] guards: ")]
    assert len(lines) == 1 and words in lines[0], result.stderr
