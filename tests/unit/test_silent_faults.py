"""The quiet faults' decisions, as tables: loss spikes (running statistics, the rule, what the
loop does under each policy), which steps are replayed, stragglers, and the lines a user
reads. No process group, no model."""

from __future__ import annotations

import io
import math

import pytest

from forge.config.resilience import ResilienceConfig
from forge.config.sections import NonFinitePolicy, SpikePolicy
from forge.resilience.faults import Fault, FaultKind, parse_faults
from forge.resilience.reports import (
    FaultReport,
    diverged_line,
    inconsistent_line,
    named,
    outvoted_line,
)
from forge.resilience.stragglers import (
    StragglerReading,
    StragglerStreak,
    next_streak,
    straggler_reading,
    timed,
    warns,
)
from forge.training.loop.plan import (
    SPIKE_WARMUP,
    SPIKE_WINDOW,
    LoopPolicy,
    NonFiniteAction,
    ReplayRule,
    is_spike,
    nonfinite_action,
    observed,
    plan_step,
    rolled_back,
)
from forge.training.loop.step_logger import resilience_record
from forge.types import (
    LoopOutcome,
    LoopState,
    LossStats,
    PendingStep,
    ReplayVerdict,
    Signals,
    StepResult,
)

WARN, SKIP, ROLLBACK = SpikePolicy.WARN, SpikePolicy.SKIP, SpikePolicy.ROLLBACK


def stats_of(losses: list[float]) -> LossStats:
    stats = LossStats()
    for loss in losses:
        stats = observed(stats, loss)
    return stats


def test_the_statistics_are_exact_for_the_first_window_then_weighted():
    losses = [float(x) for x in range(1, SPIKE_WINDOW + 1)]
    stats = stats_of(losses)
    mean = sum(losses) / len(losses)
    assert stats.count == SPIKE_WINDOW
    assert stats.mean == pytest.approx(mean)
    assert stats.var == pytest.approx(sum((x - mean) ** 2 for x in losses) / len(losses))
    after = observed(stats, 100.0)  # past the window each loss weighs 1/SPIKE_WINDOW
    assert after.mean == pytest.approx(mean + (100.0 - mean) / SPIKE_WINDOW)


FLAT = stats_of([2.0] * SPIKE_WARMUP)  # var 0: the floor (1% of the mean) measures
NOISY = stats_of([2.0, 2.2] * SPIKE_WARMUP)  # mean 2.1, deviation 0.1

# (case, loss, stats, threshold, spike)
SPIKES = [
    ("off", 1e9, NOISY, 0.0, False),
    ("before the warm-up", 1e9, stats_of([2.0] * (SPIKE_WARMUP - 1)), 6.0, False),
    ("at the warm-up", 1e9, FLAT, 6.0, True),
    ("within the threshold", 2.1 + 5.9 * 0.1, NOISY, 6.0, False),
    ("beyond the threshold", 2.1 + 6.1 * 0.1, NOISY, 6.0, True),
    ("below the mean", 0.5, NOISY, 6.0, False),
    ("a flat loss's noise", 2.1, FLAT, 6.0, False),  # 0.1 over, under 6 x 1% x 2.0
    ("a flat loss's jump", 2.2, FLAT, 6.0, True),  # 0.2 over: beyond 0.12
    ("non-finite: its own policy", math.inf, NOISY, 6.0, False),
    ("nan: its own policy", math.nan, NOISY, 6.0, False),
]


@pytest.mark.parametrize(
    "loss,stats,threshold,spike", [c[1:] for c in SPIKES], ids=[c[0] for c in SPIKES]
)
def test_the_spike_rule(loss, stats, threshold, spike):
    assert is_spike(loss, stats, threshold) is spike


# (case, nonfinite policy, spike policy, streak, spike, action)
ACTIONS = [
    ("a spike under skip", NonFinitePolicy.ROLLBACK, SKIP, 1, True, NonFiniteAction.SKIP),
    ("a spike under rollback", NonFinitePolicy.SKIP, ROLLBACK, 1, True, NonFiniteAction.ROLLBACK),
    ("a spike, abort on nan", NonFinitePolicy.ABORT, SKIP, 1, True, NonFiniteAction.SKIP),
    ("a nan, skip on spikes", NonFinitePolicy.ABORT, SKIP, 1, False, NonFiniteAction.ABORT),
    ("spikes up to the limit", NonFinitePolicy.SKIP, SKIP, 3, True, NonFiniteAction.ABORT),
    ("a spike that is not dropped", NonFinitePolicy.SKIP, WARN, 0, True, NonFiniteAction.CONTINUE),
]


@pytest.mark.parametrize(
    "nonfinite,spike_policy,streak,spike,action",
    [c[1:] for c in ACTIONS],
    ids=[c[0] for c in ACTIONS],
)
def test_a_dropped_spike_follows_its_own_policy_and_the_shared_limit(
    nonfinite, spike_policy, streak, spike, action
):
    policy = LoopPolicy(
        max_steps=20,
        nonfinite_limit=3,
        nonfinite_policy=nonfinite,
        spike_threshold=6.0,
        spike_policy=spike_policy,
    )
    assert nonfinite_action(streak, policy, spike) is action


def result(
    loss: float = 2.0,
    spike: bool = False,
    replay: ReplayVerdict | None = None,
    applied: bool = True,
) -> StepResult:
    return StepResult(
        loss=loss,
        grad_norm=1.0,
        tokens=8,
        lr=0.1,
        world_loss=loss,
        spike=spike,
        replay=replay,
        applied=applied,
    )


# (case, spike policy, spike, applied by the step, streak after, rollback, spikes, stats count)
PLANS = [
    ("a normal step joins the statistics", SKIP, False, True, 0, False, 0, 11),
    ("warn: trained on, counted, joins them", WARN, True, True, 0, False, 1, 11),
    ("skip: dropped, counted, kept out", SKIP, True, False, 1, False, 1, 10),
    ("rollback: dropped, rolled back", ROLLBACK, True, False, 1, True, 1, 10),
]


@pytest.mark.parametrize(
    "spike_policy,spike,applied,streak,rollback,spikes,count",
    [c[1:] for c in PLANS],
    ids=[c[0] for c in PLANS],
)
def test_plan_step_handles_a_spike_as_its_policy_says(
    spike_policy, spike, applied, streak, rollback, spikes, count
):
    policy = LoopPolicy(max_steps=20, spike_threshold=6.0, spike_policy=spike_policy)
    state = LoopState(step=12, loss_stats=stats_of([2.0] * 10))
    step = result(50.0 if spike else 2.0, spike, applied=applied)
    plan = plan_step(state, step, Signals(), policy)
    assert plan.state.nonfinite_streak == streak
    assert plan.state.last_step_finite is applied
    assert plan.rollback is rollback
    assert plan.state.spikes == spikes
    assert plan.state.loss_stats.count == count


def test_a_spike_dropped_under_abort_on_nan_is_skipped_not_aborted():
    """``on_nonfinite = "abort"`` ends the run at a NaN, not at a spike ``on_spike`` skips."""
    from forge.config.sections import JobConfig, ResilienceConfig
    from forge.training.loop.plan import loop_policy

    resilience = ResilienceConfig(
        on_nonfinite=NonFinitePolicy.ABORT, spike_threshold=6.0, on_spike=SKIP
    )
    policy = loop_policy(JobConfig(resilience=resilience))
    state = LoopState(step=12, loss_stats=stats_of([2.0] * 10))
    spiked = plan_step(state, result(50.0, spike=True, applied=False), Signals(), policy)
    assert spiked.stop is None and spiked.state.nonfinite_streak == 1
    nan = plan_step(state, result(math.nan), Signals(nonfinite=True), policy)
    assert nan.stop is LoopOutcome.NAN_ABORT


def test_snapshots_are_kept_when_either_policy_rolls_back():
    assert LoopPolicy(max_steps=1, nonfinite_policy=NonFinitePolicy.ROLLBACK).snapshots
    assert LoopPolicy(max_steps=1, spike_threshold=6.0, spike_policy=ROLLBACK).snapshots
    assert not LoopPolicy(max_steps=1, spike_threshold=0.0, spike_policy=ROLLBACK).snapshots
    assert not LoopPolicy(max_steps=1, spike_threshold=6.0, spike_policy=SKIP).snapshots
    assert LoopPolicy(max_steps=1, spike_threshold=6.0, spike_policy=SKIP).drops_spikes
    assert not LoopPolicy(max_steps=1, spike_threshold=6.0, spike_policy=WARN).drops_spikes


# (case, signals, verdict, stop, save, mismatches)
REPLAYS = [
    ("agreed", Signals(), ReplayVerdict(), None, "scheduled", 0),
    ("outvoted", Signals(), ReplayVerdict(mismatched=(1,)), None, "scheduled", 1),
    (
        "no majority",
        Signals(replay_failed=True),
        ReplayVerdict(mismatched=(1,), inconsistent=(1,)),
        LoopOutcome.REPLAY_MISMATCH,
        None,
        1,
    ),
]


@pytest.mark.parametrize(
    "signals,verdict,stop,save,mismatches",
    [c[1:] for c in REPLAYS],
    ids=[c[0] for c in REPLAYS],
)
def test_a_replay_without_majority_stops_the_run_without_a_save(
    signals, verdict, stop, save, mismatches
):
    from forge.checkpoint.policy import SaveSchedule

    policy = LoopPolicy(max_steps=20, schedule=SaveSchedule(interval=3))
    applied = not verdict.failed
    plan = plan_step(LoopState(step=2), result(replay=verdict, applied=applied), signals, policy)
    assert plan.stop is stop
    assert (plan.save.value if plan.save else None) == save
    assert plan.state.replay_mismatches == mismatches


# (case, rule, step, first of launch, replayed)
RULES = [
    ("off", ReplayRule(0, False), 5, True, False),
    ("every step", ReplayRule(1, False), 7, False, True),
    ("every 10th: 10", ReplayRule(10, False), 10, False, True),
    ("every 10th: 11", ReplayRule(10, False), 11, False, False),
    ("the first of a launch", ReplayRule(0, True), 37, True, True),
    ("not the second", ReplayRule(0, True), 38, False, False),
    ("the first, N=100", ReplayRule(100, True), 1, True, True),
]


@pytest.mark.parametrize(
    "rule,step,first,replayed", [c[1:] for c in RULES], ids=[c[0] for c in RULES]
)
def test_which_steps_are_replayed(rule, step, first, replayed):
    assert rule.replays(step, first) is replayed


# (busy per rank, slowest, ratio)
READINGS = [
    ([1.0, 1.0], 0, 1.0),
    ([1.0, 1.8], 1, 1.8 / 1.4),
    ([0.5, 0.5, 2.0, 0.5], 2, 4.0),
    ([0.0, 0.0], 0, 1.0),
    ([3.0, 1.0, 1.0], 0, 3.0),
]


@pytest.mark.parametrize("busy,slowest,ratio", READINGS)
def test_the_straggler_reading(busy, slowest, ratio):
    reading = straggler_reading(busy)
    assert reading.slowest_rank == slowest
    assert reading.ratio == pytest.approx(ratio)


# (streak, reading, threshold, next)
STREAKS = [
    (StragglerStreak(), StragglerReading(1, 2.0), 1.5, StragglerStreak(1, 1)),
    (StragglerStreak(1, 1), StragglerReading(1, 2.0), 1.5, StragglerStreak(1, 2)),
    (StragglerStreak(1, 2), StragglerReading(0, 2.0), 1.5, StragglerStreak(0, 1)),
    (StragglerStreak(1, 2), StragglerReading(1, 1.2), 1.5, StragglerStreak()),
    (StragglerStreak(1, 2), StragglerReading(1, 1.5), 1.5, StragglerStreak()),
]


@pytest.mark.parametrize("streak,reading,threshold,after", STREAKS)
def test_a_straggler_streak_counts_one_rank_above_the_ratio(streak, reading, threshold, after):
    assert next_streak(streak, reading, threshold) == after


def test_a_streak_warns_once_when_it_reaches_the_logs():
    assert [warns(StragglerStreak(1, n), 3) for n in range(1, 6)] == [
        False,
        False,
        True,
        False,
        False,
    ]


def test_a_timed_step_reports_its_clock_time():
    ticks = iter([10.0, 12.5])
    step = timed(lambda batch, state: result(), clock=lambda: next(ticks))
    assert step(None, LoopState()).busy_s == 2.5


# (the loader's wall clock around each batch and the end, the step's CPU clock around each
# step, each step's own time): the wait for a step's batch is the rank's own, once
WAITS = [
    ("no wait", [0.0, 0.0, 1.0, 1.0, 2.0], [0.0, 2.0, 2.0, 4.0], [2.0, 2.0]),
    ("a slow batch, then none", [0.0, 3.0, 5.0, 5.0, 6.0], [0.0, 2.0, 2.0, 4.0], [5.0, 2.0]),
    ("every batch slow", [0.0, 1.5, 2.0, 3.5, 4.0], [0.0, 1.0, 1.0, 2.0], [2.5, 2.5]),
]


@pytest.mark.parametrize("loader,cpu,own", [c[1:] for c in WAITS], ids=[c[0] for c in WAITS])
def test_a_ranks_wait_for_its_own_batches_is_its_own_time(loader, cpu, own):
    from forge.resilience.stragglers import LoaderWaits

    waits = LoaderWaits(clock=iter(loader).__next__)
    cpu_ticks = iter(cpu)
    step = timed(lambda batch, state: result(), clock=cpu_ticks.__next__, waits=waits)
    got = [step(batch, LoopState()).busy_s for batch in waits.watch(iter(["a", "b"]))]
    assert got == own
    assert waits.take() == 0.0  # each wait reported once


def test_slow_data_hands_over_batches_late_from_its_step_on_on_its_rank():
    import time

    from forge.resilience.faults import with_slow_data

    faults = parse_faults("slow_data:step=3:rank=1:seconds=0.05")
    other = iter("abc")
    assert with_slow_data(other, faults, rank=0, first_step=1) is other  # not on rank 0
    start = time.perf_counter()
    assert list(with_slow_data(iter("abcd"), faults, rank=1, first_step=2)) == list("abcd")
    assert time.perf_counter() - start >= 0.15  # steps 3, 4 and 5 each 0.05 s late


# (text, faults)
FAULTS = [
    ("corrupt:step=3:rank=1", (Fault(FaultKind.CORRUPT, 3, 1),)),
    ("corrupt:step=3:rank=1:times=3", (Fault(FaultKind.CORRUPT, 3, 1, times=3),)),
    ("slow:step=1:rank=1:seconds=0.4", (Fault(FaultKind.SLOW, 1, 1, seconds=0.4),)),
    ("slow_data:step=2:rank=1:seconds=0.4", (Fault(FaultKind.SLOW_DATA, 2, 1, seconds=0.4),)),
    ("spike:step=15:scale=1000", (Fault(FaultKind.SPIKE, 15, None, scale=1000.0),)),
    (
        "corrupt:step=2:rank=1:times=3:sticky=1",
        (Fault(FaultKind.CORRUPT, 2, 1, times=3, sticky=True),),
    ),
]


@pytest.mark.parametrize("text,faults", FAULTS)
def test_parse_the_silent_faults(text, faults):
    assert parse_faults(text) == faults


@pytest.mark.parametrize("text", ["corrupt:step=3:times=x", "spike:step=1:scale=big"])
def test_malformed_silent_faults_are_rejected(text):
    with pytest.raises(ValueError, match="FORGE_FAULTS"):
        parse_faults(text)


def test_the_lines_name_ranks_and_hosts():
    hosts = ("a", "b")
    assert named((1,), hosts) == "rank 1 (host b)"
    assert named((0, 1), hosts) == "ranks 0 (host a), 1 (host b)"
    outvoted = outvoted_line(3, ReplayVerdict(mismatched=(1,)), hosts)
    assert "step 3" in outvoted and "rank 1 (host b)" in outvoted
    lost = inconsistent_line(3, ReplayVerdict((1,), (1,)), hosts)
    assert "rank 1 (host b)" in lost and "suspect its hardware" in lost
    assert "nothing from step 3 on is saved" in lost
    apart = diverged_line(2, ReplayVerdict(diverged=(0, 1)), hosts)
    assert "ranks 0 (host a), 1 (host b)" in apart and "replicas" in apart


# (verdict, whether the step may not be applied, the lines FaultReport prints)
VERDICT_LINES = [
    (ReplayVerdict(), False, []),
    (ReplayVerdict(mismatched=(1,)), False, ["warning: step 4 computed differently"]),
    (ReplayVerdict((1,), (1,)), True, ["error: step 4 came out three different ways"]),
    (ReplayVerdict(diverged=(0, 1)), True, ["error: at step 4 the gradients"]),
]


@pytest.mark.parametrize("verdict,failed,starts", VERDICT_LINES)
def test_each_verdict_has_its_line(verdict, failed, starts):
    assert verdict.failed is failed
    lines = FaultReport(True, ("a", "b"), WARN).lines(4, result(replay=verdict))
    assert [line[: len(s)] for line, s in zip(lines, starts, strict=True)] == starts


def test_the_report_prints_on_rank_zero_only():
    pending = PendingStep(15, result(4501.0, spike=True))
    for is_main, expected in ((True, 1), (False, 0)):
        out = io.StringIO()
        FaultReport(is_main, ("h",), SKIP, out).on_before_optimizer_step(pending, None, None)  # type: ignore[arg-type]
        lines = out.getvalue().splitlines()
        assert len(lines) == expected
        if lines:
            assert "step 15's loss 4501" in lines[0] and "update was dropped" in lines[0]


def test_the_resilience_counts_are_logged_where_their_checks_are_on():
    state = LoopState(spikes=2, replay_mismatches=1)
    assert resilience_record(state, ResilienceConfig()) == {"resilience/replay_mismatches": 1}
    assert resilience_record(LoopState(), ResilienceConfig()) == {}
    on = ResilienceConfig(spike_threshold=6.0, replay_interval=10)
    assert resilience_record(state, on) == {
        "resilience/spikes": 2,
        "resilience/replay_mismatches": 1,
    }


# (case, this rank's loss, the control word, the spike flag, non-finite steps counted)
NONFINITE_COUNTS = [
    ("a finite step", 2.0, Signals(), False, 0),
    ("this rank's loss not finite", math.nan, Signals(nonfinite=True), False, 1),
    ("a peer's step not finite (the control word)", 2.0, Signals(nonfinite=True), False, 1),
    ("a spike is finite: not counted here", 4501.0, Signals(), True, 0),
]  # fmt: skip


@pytest.mark.parametrize(
    "loss,signals,spike,counted",
    [c[1:] for c in NONFINITE_COUNTS],
    ids=[c[0] for c in NONFINITE_COUNTS],
)
def test_a_step_not_finite_on_any_rank_is_counted_through_a_rollback(loss, signals, spike, counted):
    policy = LoopPolicy(
        max_steps=10, nonfinite_policy=NonFinitePolicy.ROLLBACK, spike_threshold=6.0
    )
    state = LoopState(step=4, nonfinite_steps=2)
    plan = plan_step(state, result(loss, spike=spike), signals, policy)
    assert plan.state.nonfinite_steps == 2 + counted
    if plan.rollback:  # the run's count, not the snapshot's
        assert rolled_back(plan.state, LoopState(step=3)).nonfinite_steps == 2 + counted


# (case, the policy, whether the step was dropped as not finite, rank 0?, the line)
NONFINITE_LINES = [
    ("skip", NonFinitePolicy.SKIP, True, True, 'step 7 was not finite (loss or gradient norm) on some rank: its update was dropped (resilience.on_nonfinite = "skip")'),
    ("rollback", NonFinitePolicy.ROLLBACK, True, True, 'step 7 was not finite (loss or gradient norm) on some rank: its update was dropped and the model goes back to the last snapshot (resilience.on_nonfinite = "rollback")'),
    ("abort: the run's error names it", NonFinitePolicy.ABORT, True, True, None),
    ("a finite step", NonFinitePolicy.SKIP, False, True, None),
    ("another rank than 0", NonFinitePolicy.SKIP, True, False, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "policy,dropped,is_main,line",
    [n[1:] for n in NONFINITE_LINES],
    ids=[n[0] for n in NONFINITE_LINES],
)
def test_a_step_dropped_as_not_finite_has_one_line(policy, dropped, is_main, line):
    out = io.StringIO()
    report = FaultReport(is_main, ("h",), SKIP, out, nonfinite_policy=policy)
    report.on_train_begin(LoopState(step=4, nonfinite_steps=1))  # a resumed run's count
    after = LoopState(step=7, nonfinite_steps=1 + dropped, failed_at=7 if dropped else None)
    report.on_step_end(after, result())
    report.on_step_end(after, result())  # the next step, nothing new: no second line
    assert out.getvalue().splitlines() == ([f"[forge] warning: {line}"] if line else [])


def test_the_non_finite_count_is_logged_once_a_step_was():
    assert "resilience/nonfinite_steps" not in resilience_record(LoopState(), ResilienceConfig())
    counted = resilience_record(LoopState(nonfinite_steps=3), ResilienceConfig())
    assert counted["resilience/nonfinite_steps"] == 3
