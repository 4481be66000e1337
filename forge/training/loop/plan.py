"""The loop's state machine: its fixed policy and its pure decisions. No torch here: every
function is table-tested (the values it decides on are in ``forge.types``).

One step of the reducer: ``plan_step(state, result, signals, policy) -> StepPlan``, whose
``state`` is the next ``LoopState`` and whose flags say which effects run.

Bookkeeping rule for a non-finite (skipped) step: the update is dropped, but the step counter,
the LR schedule position, the data position and the token count all advance as for a normal
step, and the shutdown poll and checkpoint gate still run.

Rollback (``resilience.on_nonfinite = "rollback"``): the model and optimizer return to the last
in-memory snapshot (step ``s``); the step counter (and so the LR) returns to ``s``; the data
position does not, so the batches of steps ``s+1..k`` that led to the failure are skipped, and
the range is recorded in ``LoopState.skipped_ranges``. The streak of dropped steps clears only
when the latest failed step, or one past it, is applied (``LoopState.failed_at``): a step that fails
again each time the run comes back to it counts toward ``max_consecutive_nonfinite`` as if the
good steps between were not there, so a step that always fails ends the run (NAN_ABORT, naming
the step) instead of rolling back forever. Under skip the step counter only moves on, so the
step after a failure already passes it.

A loss spike (``resilience.spike_threshold``) is measured against running statistics of the
steps applied so far (``observed``, ``is_spike``), which the loop state carries into every
checkpoint; under ``on_spike = "skip"`` or ``"rollback"`` a spiking step is handled as a
non-finite one under that policy, and counts toward the same streak.
"""

from __future__ import annotations

import enum
import math

import attrs

from forge.checkpoint.policy import SaveSchedule
from forge.config.sections import JobConfig, NonFinitePolicy, SpikePolicy
from forge.training.loop.finalize import FAILURES
from forge.types import Float8Drift, LoopOutcome, LoopState, LossStats, Signals, StepResult

SPIKE_WARMUP = 10  # applied steps in the statistics before a loss can be called a spike
SPIKE_WINDOW = 20  # the statistics' horizon in steps: each new loss weighs at least 1/20
SPIKE_FLOOR = 0.01  # the deviation a spike is measured in is at least 1% of the mean
# a spike whose update is dropped is handled as a non-finite step under this policy
DROPPED_SPIKE = {
    SpikePolicy.SKIP: NonFinitePolicy.SKIP,
    SpikePolicy.ROLLBACK: NonFinitePolicy.ROLLBACK,
}


@attrs.frozen
class LoopPolicy:
    """The loop's fixed parameters. ``schedule`` None: checkpointing is off."""

    max_steps: int
    log_interval: int = 10
    eval_interval: int = 0
    schedule: SaveSchedule | None = None
    nonfinite_limit: int = 3
    nonfinite_policy: NonFinitePolicy = NonFinitePolicy.SKIP
    snapshot_interval: int = 0  # rollback snapshots every this many steps (0: only at start)
    spike_threshold: float = 0.0  # deviations above the running mean (0: no spike rule)
    spike_policy: SpikePolicy = SpikePolicy.WARN

    @property
    def drops_spikes(self) -> bool:
        """Whether a spiking step's update is dropped (``on_spike`` skip or rollback)."""
        return self.spike_threshold > 0 and self.spike_policy is not SpikePolicy.WARN

    @property
    def snapshots(self) -> bool:
        """Whether a rollback may happen, so that the loop keeps an in-memory snapshot."""
        return self.nonfinite_policy is NonFinitePolicy.ROLLBACK or (
            self.spike_threshold > 0 and self.spike_policy is SpikePolicy.ROLLBACK
        )


def loop_policy(config: JobConfig) -> LoopPolicy:
    """The loop's fixed parameters from the config."""
    ck = config.checkpoint
    schedule = None
    if ck.enabled:
        window = ck.dyn_ckpt_window
        schedule = SaveSchedule(
            interval=ck.interval,
            window_start=window.start if window else None,
            window_stop=window.stop if window else None,
        )
    return LoopPolicy(
        max_steps=config.train.max_steps,
        log_interval=config.metrics.log_interval,
        eval_interval=config.eval.in_loop_interval,
        schedule=schedule,
        nonfinite_limit=config.resilience.max_consecutive_nonfinite,
        nonfinite_policy=config.resilience.on_nonfinite,
        snapshot_interval=config.resilience.snapshot_interval,
        spike_threshold=config.resilience.spike_threshold,
        spike_policy=config.resilience.on_spike,
    )


class NonFiniteAction(enum.Enum):
    CONTINUE = "continue"  # the step was finite
    SKIP = "skip"  # drop the update, go on
    ROLLBACK = "rollback"  # restore the last snapshot, skip the failing window
    ABORT = "abort"  # end the run: NAN_ABORT


def nonfinite_action(streak: int, policy: LoopPolicy, spike: bool = False) -> NonFiniteAction:
    """The NaN state machine: what a run does after ``streak`` consecutive dropped steps, the
    last of them non-finite, or (``spike``) a finite spike under ``on_spike``."""
    if streak == 0:
        return NonFiniteAction.CONTINUE
    rule = policy.nonfinite_policy
    if spike and policy.drops_spikes:
        rule = DROPPED_SPIKE[policy.spike_policy]
    if streak >= policy.nonfinite_limit or rule is NonFinitePolicy.ABORT:
        return NonFiniteAction.ABORT
    if rule is NonFinitePolicy.ROLLBACK:
        return NonFiniteAction.ROLLBACK
    return NonFiniteAction.SKIP


def observed(stats: LossStats, loss: float) -> LossStats:
    """The running statistics with ``loss`` taken in: an exact mean and variance for the
    first ``SPIKE_WINDOW`` steps, exponentially weighted after."""
    count = stats.count + 1
    alpha = max(1.0 / count, 1.0 / SPIKE_WINDOW)
    delta = loss - stats.mean
    return LossStats(
        count=count,
        mean=stats.mean + alpha * delta,
        var=(1.0 - alpha) * (stats.var + alpha * delta * delta),
    )


def is_spike(loss: float, stats: LossStats, threshold: float) -> bool:
    """Whether a finite ``loss`` lies more than ``threshold`` deviations above the running
    mean (the deviation at least ``SPIKE_FLOOR`` of the mean, so that a flat loss does not
    make noise a spike). Off (``threshold`` 0), and never before ``SPIKE_WARMUP`` steps."""
    if threshold <= 0 or stats.count < SPIKE_WARMUP or not math.isfinite(loss):
        return False
    deviation = max(math.sqrt(stats.var), SPIKE_FLOOR * abs(stats.mean))
    return loss > stats.mean + threshold * deviation


@attrs.frozen
class ReplayRule:
    """Which steps are replayed: every ``interval``-th (0: none), and the first step of every
    launch when ``first_step``."""

    interval: int = 0
    first_step: bool = False

    def replays(self, step: int, first_of_launch: bool) -> bool:
        """Whether step ``step`` (1-based) is replayed."""
        return (self.interval > 0 and step % self.interval == 0) or (
            self.first_step and first_of_launch
        )

    @classmethod
    def configured(cls, config: JobConfig) -> ReplayRule:
        """The replays ``[resilience]`` asks for (``ReplayRule()``: none)."""
        res = config.resilience
        return cls(res.replay_interval, res.replay_first_step)


class SaveReason(enum.Enum):
    SCHEDULED = "scheduled"
    EMERGENCY = "emergency"
    FINAL = "final"


def save_failure_is_fatal(
    reason: SaveReason, step: int, max_steps: int, abandoned: bool = False
) -> bool:
    """Whether a failed save ends the run. A periodic save that fails mid-run is reported and
    training goes on (the next one may succeed, as in torchtitan); the final save, an
    emergency save, or any save of the last step is the run's last chance to keep its work,
    so its failure fails the run. So does a save given up on while its write still runs
    (``abandoned``: a store that stopped answering): that write cannot be stopped, and its
    thread would still run DCP's collectives on the checkpoint group, interleaved with the
    next save's — the run ends, and its relaunch resumes from the last commit."""
    return abandoned or reason is not SaveReason.SCHEDULED or step >= max_steps


@attrs.frozen
class StepPlan:
    """The next state and the effects to run after one step."""

    state: LoopState
    log: bool = False
    evaluate: bool = False
    save: SaveReason | None = None
    stop: LoopOutcome | None = None
    rollback: bool = False  # restore the last snapshot (then ``rolled_back`` gives the state)
    snapshot: bool = False  # refresh the rollback snapshot at this state
    commit: bool = False  # commit the save in flight, written on every rank


def advance(state: LoopState, result: StepResult, finite: bool = True) -> LoopState:
    """Bookkeeping after a step, skipped or not (see the module docstring). ``finite`` is the
    world-reduced verdict: false if any rank's step was not finite. A step whose update was
    applied (``result.applied``, as the step decided) enters the loss statistics with its
    world loss, a spike kept under ``on_spike = "warn"`` included: it is the run's loss now."""
    ok = finite and result.finite
    applied = ok and result.applied
    step = state.step + 1
    recovered = applied and (state.failed_at is None or step >= state.failed_at)
    stats = state.loss_stats
    if applied and result.world_loss is not None:
        stats = observed(stats, result.world_loss)
    replay = result.replay
    disagreed = replay is not None and bool(replay.mismatched or replay.diverged)
    fell_back = result.float8 is not None and result.float8.action is Float8Drift.FALLBACK
    return attrs.evolve(
        state,
        step=step,
        tokens_seen=state.tokens_seen + result.tokens,
        nonfinite_streak=0 if recovered else state.nonfinite_streak + (not applied),
        failed_at=None if recovered else max(step, state.failed_at or 0),
        last_step_finite=applied,
        loss_stats=stats,
        spikes=state.spikes + (ok and result.spike),
        nonfinite_steps=state.nonfinite_steps + (not ok),
        replay_mismatches=state.replay_mismatches + disagreed,
        float8_fallback_step=state.float8_fallback_step or (step if fell_back else None),
    )


def stop_outcome(
    state: LoopState, signals: Signals, policy: LoopPolicy, action: NonFiniteAction
) -> LoopOutcome | None:
    """Why the loop stops after reaching ``state``, most severe first; None to go on."""
    if signals.health_failed:
        return LoopOutcome.HEALTH_FAILURE
    if signals.replay_failed:
        return LoopOutcome.REPLAY_MISMATCH
    if signals.float8_stopped:
        return LoopOutcome.FLOAT8_DRIFT
    if action is NonFiniteAction.ABORT:
        return LoopOutcome.NAN_ABORT
    if signals.shutdown_requested:
        return LoopOutcome.SHUTDOWN
    if action is NonFiniteAction.ROLLBACK:
        return None  # the step counter is about to go back
    if state.step >= policy.max_steps:
        return LoopOutcome.COMPLETED
    return None


def save_reason(
    state: LoopState, stop: LoopOutcome | None, policy: LoopPolicy, rollback: bool = False
) -> SaveReason | None:
    """Scheduled or emergency save after reaching ``state``; never on a failure stop, nor on a
    step about to be rolled back."""
    if policy.schedule is None or stop in FAILURES:
        return None
    if rollback:
        return None
    if stop is LoopOutcome.SHUTDOWN:
        return SaveReason.EMERGENCY
    if policy.schedule.should_save(state.step):
        return SaveReason.SCHEDULED
    return None


def plan_step(
    state: LoopState, result: StepResult, signals: Signals, policy: LoopPolicy
) -> StepPlan:
    """Pure: the next state and which effects (log, eval, save, snapshot, rollback, stop)
    follow this step. ``signals`` is the world-reduced control word."""
    nxt = advance(state, result, not signals.nonfinite)
    spike = result.spike and not signals.nonfinite and result.finite
    # an applied step short of the failed one keeps the streak but is no failure itself
    action = nonfinite_action(0 if nxt.last_step_finite else nxt.nonfinite_streak, policy, spike)
    stop = stop_outcome(nxt, signals, policy, action)
    rollback = action is NonFiniteAction.ROLLBACK and stop is None
    reason = save_reason(nxt, stop, policy, rollback)
    if reason is not None:
        nxt = attrs.evolve(nxt, last_saved_step=nxt.step)
    interval = policy.snapshot_interval
    return StepPlan(
        state=nxt,
        # after a health failure no effect may run a collective: a peer may be gone
        log=(nxt.step % policy.log_interval == 0 or stop is not None or nxt.step == 1)
        and stop is not LoopOutcome.HEALTH_FAILURE,
        evaluate=policy.eval_interval > 0
        and nxt.step % policy.eval_interval == 0
        and stop in (None, LoopOutcome.COMPLETED)
        and not rollback,
        save=reason,
        stop=stop,
        rollback=rollback,
        snapshot=policy.snapshots
        and interval > 0
        and nxt.step % interval == 0
        and nxt.last_step_finite
        and stop is None,
        # a save of this step waits for it first, and a stop's conclusion does
        commit=signals.save_written and reason is None and stop is None,
    )


def rolled_back(current: LoopState, snapshot: LoopState) -> LoopState:
    """The state after restoring ``snapshot``: its step (and so its LR) and its loss
    statistics, but the data already consumed stays consumed, the skipped window is recorded,
    and the run's counts of spikes and replay mismatches stand."""
    return attrs.evolve(
        snapshot,
        tokens_seen=current.tokens_seen,
        nonfinite_streak=current.nonfinite_streak,
        failed_at=current.failed_at,  # the streak clears only once it is applied
        last_saved_step=current.last_saved_step,
        last_step_finite=False,
        skipped_ranges=(*current.skipped_ranges, (snapshot.step + 1, current.step)),
        spikes=current.spikes,  # counts of the run, not of the model's state
        replay_mismatches=current.replay_mismatches,
        nonfinite_steps=current.nonfinite_steps,
        float8_fallback_step=current.float8_fallback_step,  # the model computes as it did
    )


def starting_outcome(state: LoopState, policy: LoopPolicy) -> LoopOutcome | None:
    """ALREADY_COMPLETE when a resumed run has nothing left to do."""
    return LoopOutcome.ALREADY_COMPLETE if state.step >= policy.max_steps else None


def saves_initial_milestone(state: LoopState, policy: LoopPolicy) -> bool:
    """A fresh run saves ``step_0`` when step 0 is a milestone of the dynamic window."""
    return (
        policy.schedule is not None
        and state.step == 0
        and state.last_saved_step is None
        and policy.schedule.is_milestone(0)
    )
