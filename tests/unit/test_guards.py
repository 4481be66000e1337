"""The start's guards: armed (its one line) or refused by name, one row per case (pure)."""

from __future__ import annotations

import attrs
import pytest

from forge.config.loader import structure_config
from forge.config.sections import JobConfig
from forge.training.loop.plan import ReplayRule
from forge.training.setup.guard_rules import (
    GuardFacts,
    agreed_refusals,
    guard_report,
    operations_by_rank,
    rank_span,
)
from forge.training.steps.float8_check import Float8CheckRule
from forge.types import Float8Drift

FIRST = ReplayRule(0, True)
ONE = GuardFacts(
    world_size=1,
    cuda=False,
    snapshots=False,
    spike_threshold=0.0,
    drops_spikes=False,
    replay=FIRST,
    replica_layout=1,
    replicated=0,
    signals=True,
)
TWO = attrs.evolve(ONE, world_size=2)
REPLICAS = attrs.evolve(TWO, replica_layout=2, replicated=14)


def config(**sections) -> JobConfig:
    return structure_config(sections)


ROLL = {"on_nonfinite": "rollback"}
FP8_CHECK = {"float8": "rowwise", "float8_check": 10, "float8_on_drift": "stop"}
CHECK = Float8CheckRule(10, 0.05, 0.5, Float8Drift.STOP)
SPIKE_SKIP = {"spike_threshold": 6.0, "on_spike": "skip"}

# (case, config sections, facts, the line's words, the keys refused)
ROWS = [
    ("defaults, one process", {}, ONE, "nonfinite=skip, replay first step, signals, checksums(full)", []),
    ("no checkpoint: signals say so", {"checkpoint": {"enabled": False}}, ONE, "nonfinite=skip, replay first step, signals(no checkpoint)", []),
    ("two ranks on a CPU", {}, TWO, "nonfinite=skip, replay first step, stragglers(1.5x), health(300 s), hang stacks(600 s), signals, checksums(full)", []),
    ("two ranks on CUDA: no straggler reading", {}, attrs.evolve(TWO, cuda=True), "nonfinite=skip, replay first step, health(300 s), hang stacks(600 s), signals, checksums(full)", []),
    ("a straggler key on CUDA is refused", {"resilience": {"straggler_ratio": 2.0}}, attrs.evolve(TWO, cuda=True), None, ["resilience.straggler_ratio"]),
    ("a straggler key at one process is refused by its name", {"resilience": {"straggler_logs": 9}}, ONE, None, ["resilience.straggler_logs"]),
    ("both straggler keys: the first named", {"resilience": {"straggler_ratio": 2.0, "straggler_logs": 9}}, attrs.evolve(ONE, cuda=True), None, ["resilience.straggler_ratio"]),
    ("a health key at one process is refused", {"resilience": {"health_timeout_s": 30.0}}, ONE, None, ["resilience.health_timeout_s"]),
    ("a health interval at one process is refused", {"resilience": {"health_check_interval": 10}}, ONE, None, ["resilience.health_check_interval"]),
    ("a health key at two ranks is armed", {"resilience": {"health_timeout_s": 30.0}}, TWO, "nonfinite=skip, replay first step, stragglers(1.5x), health(30 s), hang stacks(600 s), signals, checksums(full)", []),
    ("health checks turned off at one process: nothing turned on", {"resilience": {"health_check_interval": 0}}, ONE, "nonfinite=skip, replay first step, signals, checksums(full)", []),
    ("the straggler clock broken, straggler_logs set: that key named", {"resilience": {"straggler_logs": 5}}, attrs.evolve(TWO, straggler_clock=False), None, ["resilience.straggler_logs"]),
    ("the control word's group missing, its interval set: that key named", {"resilience": {"health_check_interval": 5}}, attrs.evolve(TWO, health=False), None, ["resilience.health_check_interval"]),
    ("health keys at their defaults at one process: nothing to refuse", {"resilience": {"health_timeout_s": 300.0, "health_check_interval": 100}}, ONE, "nonfinite=skip, replay first step, signals, checksums(full)", []),
    ("a straggler key at two ranks is armed", {"resilience": {"straggler_ratio": 3.0}}, TWO, "nonfinite=skip, replay first step, stragglers(3x), health(300 s), hang stacks(600 s), signals, checksums(full)", []),
    ("rollback with its snapshot", {"resilience": ROLL}, attrs.evolve(ONE, snapshots=True), "nonfinite=rollback, replay first step, signals, checksums(full)", []),
    ("rollback without a snapshot", {"resilience": ROLL}, ONE, None, ["resilience.on_nonfinite"]),
    ("spikes measured by the step", {"resilience": SPIKE_SKIP}, attrs.evolve(ONE, spike_threshold=6.0, drops_spikes=True), "nonfinite=skip, spikes=skip(6σ), replay first step, signals, checksums(full)", []),
    ("spikes the step does not measure", {"resilience": SPIKE_SKIP}, ONE, None, ["resilience.spike_threshold"]),
    ("on_spike without a threshold does nothing", {"resilience": {"on_spike": "rollback"}}, ONE, None, ["resilience.on_spike"]),
    ("replays every 50 with replicas", {"resilience": {"replay_interval": 50}}, attrs.evolve(REPLICAS, replay=ReplayRule(50, True)), "nonfinite=skip, replay every 50 + first step (2 replicas), stragglers(1.5x), health(300 s), hang stacks(600 s), signals, checksums(full)", []),
    ("replays the step does not make", {"resilience": {"replay_interval": 50}}, ONE, None, ["resilience.replay_interval"]),
    ("the first step's replay over an operation without a deterministic kernel: its key", {}, attrs.evolve(ONE, cuda=True, unverifiable=(("put_", (0,)),)), None, ["resilience.replay_first_step"]),
    ("an interval's replays over one: the interval named", {"resilience": {"replay_interval": 50}}, attrs.evolve(ONE, cuda=True, replay=ReplayRule(50, True), unverifiable=(("put_", (0,)),)), None, ["resilience.replay_interval"]),
    ("the first step's replays the step does not make: its key", {}, attrs.evolve(ONE, replay=ReplayRule()), None, ["resilience.replay_first_step"]),
    ("no replay: the probe found nothing to refuse", {"resilience": {"replay_first_step": False}}, attrs.evolve(ONE, replay=ReplayRule()), "nonfinite=skip, signals, checksums(full)", []),
    ("every operation with a deterministic kernel: armed", {}, attrs.evolve(TWO, cuda=True), "nonfinite=skip, replay first step, health(300 s), hang stacks(600 s), signals, checksums(full)", []),
    ("no replay at all: nothing to say of it", {"resilience": {"replay_first_step": False}}, attrs.evolve(ONE, replay=ReplayRule()), "nonfinite=skip, signals, checksums(full)", []),
    ("replicas promised, none replicated", {"distributed": {"dp_replicate": 2}}, attrs.evolve(REPLICAS, replicated=0), None, ["distributed.dp_replicate"]),
    ("replicas without a replay: nothing compares them", {"distributed": {"dp_replicate": 2}, "resilience": {"replay_first_step": False}}, attrs.evolve(REPLICAS, replicated=0, replay=ReplayRule()), "nonfinite=skip, stragglers(1.5x), health(300 s), hang stacks(600 s), signals, checksums(full)", []),
    ("signals taken by another handler", {}, attrs.evolve(ONE, signals=False), None, ["resilience.shutdown_timeout_s"]),
    ("two ranks whose control word has no group", {}, attrs.evolve(TWO, health=False), None, ["resilience.health_timeout_s"]),
    ("one process needs no control-word group", {}, attrs.evolve(ONE, health=False), "nonfinite=skip, replay first step, signals, checksums(full)", []),
    ("two ranks whose step is not timed", {}, attrs.evolve(TWO, straggler_clock=False), None, ["resilience.straggler_ratio"]),
    ("two ranks whose hang watchdog writes no stacks", {}, attrs.evolve(TWO, hang_watch=False), None, ["distributed.timeout_s"]),
    ("one process has no hang watchdog to arm", {}, attrs.evolve(ONE, hang_watch=False), "nonfinite=skip, replay first step, signals, checksums(full)", []),
    ("on CUDA the step's own time is not read", {}, attrs.evolve(TWO, cuda=True, straggler_clock=False), "nonfinite=skip, replay first step, health(300 s), hang stacks(600 s), signals, checksums(full)", []),
    ("an FP8 drift check on FP8 layers", {"train": FP8_CHECK}, attrs.evolve(ONE, float8_check=CHECK, float8_layers=14), "nonfinite=skip, replay first step, signals, checksums(full), float8 check every 10 (5% loss, 50% grad norm: stop)", []),
    ("a tolerance under 1% keeps its digits", {"train": {**FP8_CHECK, "float8_check_tolerance": 0.005, "float8_check_grad_tolerance": 0.125}}, attrs.evolve(ONE, float8_check=attrs.evolve(CHECK, tolerance=0.005, grad_tolerance=0.125), float8_layers=14), "nonfinite=skip, replay first step, signals, checksums(full), float8 check every 10 (0.5% loss, 12.5% grad norm: stop)", []),
    ("an FP8 drift check the step does not make", {"train": FP8_CHECK}, attrs.evolve(ONE, float8_layers=14), None, ["train.float8_check"]),
    ("a spike rule in a run shorter than its warm-up", {"resilience": SPIKE_SKIP, "train": {"max_steps": 10}, "scheduler": {"warmup_steps": 1}}, attrs.evolve(ONE, spike_threshold=6.0, drops_spikes=True), None, ["resilience.spike_threshold"]),
    ("a spike rule with one step past its warm-up", {"resilience": SPIKE_SKIP, "train": {"max_steps": 11}, "scheduler": {"warmup_steps": 1}}, attrs.evolve(ONE, spike_threshold=6.0, drops_spikes=True), "nonfinite=skip, spikes=skip(6σ), replay first step, signals, checksums(full)", []),
    ("an interval past the run's end, nothing else replayed", {"resilience": {"replay_interval": 9, "replay_first_step": False}, "train": {"max_steps": 8}, "scheduler": {"warmup_steps": 1}}, attrs.evolve(ONE, replay=ReplayRule(9, False)), None, ["resilience.replay_interval"]),
    ("an interval at the run's end", {"resilience": {"replay_interval": 8, "replay_first_step": False}, "train": {"max_steps": 8}, "scheduler": {"warmup_steps": 1}}, attrs.evolve(ONE, replay=ReplayRule(8, False)), "nonfinite=skip, replay every 8, signals, checksums(full)", []),
    ("an interval past the end beside the first step's replay", {"resilience": {"replay_interval": 9}, "train": {"max_steps": 8}, "scheduler": {"warmup_steps": 1}}, attrs.evolve(ONE, replay=ReplayRule(9, True)), "nonfinite=skip, replay every 9 + first step, signals, checksums(full)", []),
    ("an FP8 check past the run's end", {"train": {**FP8_CHECK, "max_steps": 9}, "scheduler": {"warmup_steps": 1}}, attrs.evolve(ONE, float8_check=CHECK, float8_layers=14), None, ["train.float8_check"]),
    ("an FP8 check at the run's end", {"train": {**FP8_CHECK, "max_steps": 10}, "scheduler": {"warmup_steps": 1}}, attrs.evolve(ONE, float8_check=CHECK, float8_layers=14), "nonfinite=skip, replay first step, signals, checksums(full), float8 check every 10 (5% loss, 50% grad norm: stop)", []),
    ("an FP8 drift check with no FP8 layer", {"train": FP8_CHECK}, attrs.evolve(ONE, float8_check=CHECK), None, ["train.float8_check"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "sections,facts,line,refused", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_guard_report(sections, facts, line, refused):
    words, problems = guard_report(config(**sections), facts)
    assert [key for key, _ in problems] == refused
    if line is not None:
        assert words == line


# (case, each rank's operations, the words naming them)
OPERATIONS = [
    ("one process", [["put_"]], "runs put_ without"),
    ("every rank alike: no rank named", [["put_"], ["put_"]], "runs put_ without"),
    ("each by name, a rank's own named", [["put_"], ["put_", "index_add_cuda_"]], "runs index_add_cuda_ (on rank 1), put_ without"),
    ("a span of ranks", [["put_"], ["put_"], [], ["put_"]], "runs put_ (on ranks 0-1, 3) without"),
]  # fmt: skip


@pytest.mark.parametrize(
    "per_rank,words", [r[1:] for r in OPERATIONS], ids=[r[0] for r in OPERATIONS]
)
def test_an_unverifiable_replay_names_each_operation_its_ranks_and_the_way_out(per_rank, words):
    facts = attrs.evolve(ONE, world_size=len(per_rank), unverifiable=operations_by_rank(per_rank))
    problems = [p for p in guard_report(config(), facts)[1] if "deterministic" in p[1]]
    ((key, message),) = problems
    assert key == "resilience.replay_first_step"
    assert words in message
    assert "replay_interval = 0 and resilience.replay_first_step = false" in message


A, B = ("resilience.shutdown_timeout_s", "blocked"), ("resilience.replay_interval", "put_")

# (case, each rank's refusals, what every rank refuses with)
AGREED = [
    ("none anywhere", [[], []], []),
    ("one process", [[A]], [A]),
    ("every rank alike: as is", [[A], [A]], [A]),
    ("one rank alone: named", [[], [A]], [(A[0], "blocked (on rank 1)")]),
    ("some ranks: a span", [[B], [B], [], [A], [B]], [(B[0], "put_ (on ranks 0-1, 4)"), (A[0], "blocked (on rank 3)")]),
    ("each once, in the order first found", [[B, A], [A]], [(B[0], "put_ (on rank 0)"), A]),
]  # fmt: skip


@pytest.mark.parametrize("per_rank,agreed", [r[1:] for r in AGREED], ids=[r[0] for r in AGREED])
def test_every_rank_refuses_with_every_ranks_refusals(per_rank, agreed):
    assert agreed_refusals(per_rank) == agreed


@pytest.mark.parametrize(
    "ranks,words",
    [([3], "rank 3"), ([1, 3], "ranks 1, 3"), ([8, 9, 10, 11, 20], "ranks 8-11, 20"), ([5, 4], "ranks 4-5")],
)  # fmt: skip
def test_rank_span(ranks, words):
    assert rank_span(ranks) == words
