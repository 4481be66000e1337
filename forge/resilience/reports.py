"""What a user reads about the quiet faults a step revealed: a loss spike, a replayed step
whose computations disagreed (outvoted, or without a majority). The lines are pure functions;
``FaultReport`` prints them once, on rank 0, as the step that revealed them is about to be
applied (or not)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from forge.config.resilience import NonFinitePolicy, SpikePolicy
from forge.config.train import FLOAT8_OFF
from forge.types import (
    Float8Drift,
    Float8Verdict,
    Hooks,
    LoopState,
    PendingStep,
    ReplayVerdict,
    StepResult,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

# what happens to a spiking step under each ``resilience.on_spike``
SPIKE_HANDLING = {
    SpikePolicy.WARN: 'trained on (resilience.on_spike = "warn")',
    SpikePolicy.SKIP: 'its update was dropped (resilience.on_spike = "skip")',
    SpikePolicy.ROLLBACK: "its update was dropped and the model goes back to the last snapshot "
    '(resilience.on_spike = "rollback"), unless the run stops',
}


# what happens to a non-finite step under each ``resilience.on_nonfinite`` (abort: its error)
NONFINITE_HANDLING = {
    NonFinitePolicy.SKIP: 'its update was dropped (resilience.on_nonfinite = "skip")',
    NonFinitePolicy.ROLLBACK: "its update was dropped and the model goes back to the last "
    'snapshot (resilience.on_nonfinite = "rollback")',
}


def named(ranks: Sequence[int], hosts: Sequence[str]) -> str:
    """``rank 1 (host a)`` or ``ranks 0 (host a), 1 (host b)``."""
    parts = [f"{r} (host {hosts[r] if r < len(hosts) else '?'})" for r in ranks]
    return ("rank " if len(parts) == 1 else "ranks ") + ", ".join(parts)


def spike_line(step: int, loss: float, policy: SpikePolicy) -> str:
    """The warning for a step whose loss was a spike."""
    return (
        f"step {step}'s loss {loss:.6g} is a spike (above resilience.spike_threshold "
        f"deviations over its running mean): {SPIKE_HANDLING[policy]}"
    )


def nonfinite_line(step: int, policy: NonFinitePolicy) -> str | None:
    """The warning for a step not finite on some rank (None under abort: the run's error
    names it)."""
    handling = NONFINITE_HANDLING.get(policy)
    if handling is None:
        return None
    return f"step {step} was not finite (loss or gradient norm) on some rank: {handling}"


def outvoted_line(step: int, verdict: ReplayVerdict, hosts: Sequence[str]) -> str:
    """The warning for a replayed step whose first two computations disagreed on some rank
    and a third settled it."""
    return (
        f"step {step} computed differently twice on {named(verdict.mismatched, hosts)}; a "
        "third computation agreed with one of them and the step went on with it. One such "
        "step is a transient fault; if it recurs on the same rank, suspect its hardware"
    )


def inconsistent_line(step: int, verdict: ReplayVerdict, hosts: Sequence[str]) -> str:
    """The error for a replayed step with no majority on some rank (exit 6)."""
    return (
        f"step {step} came out three different ways on {named(verdict.inconsistent, hosts)}: "
        "a rank computes inconsistently, suspect its hardware. The step was not applied and "
        f"nothing from step {step} on is saved; resume from the last checkpoint on other "
        "hardware (exclude that node)"
    )


def diverged_line(step: int, verdict: ReplayVerdict, hosts: Sequence[str]) -> str:
    """The error for replicas whose gradients differ after a replayed step (exit 6)."""
    return (
        f"at step {step} the gradients of {named(verdict.diverged, hosts)} differ from those "
        "its replicas hold (data-parallel replicas or tensor-parallel ranks must hold them bit "
        "for bit after the reduction): suspect that rank's hardware or interconnect. The step "
        f"was not applied and nothing from step {step} on is saved; resume from the last "
        "checkpoint on other hardware (exclude that node)"
    )


def uncompared_line(step: int, verdict: ReplayVerdict) -> str:
    """The warning for a replayed step that could not be compared bit for bit."""
    ops = ", ".join(verdict.unverifiable) or "an operation on another rank"
    return (
        f"step {step} could not be replayed bit for bit ({ops} has no deterministic kernel on "
        "this device): replays are off for this launch; set resilience.replay_interval = 0 "
        "and replay_first_step = false to skip them"
    )


# what the run does with an FP8 step that drifted (train.float8_on_drift)
DRIFT_HANDLING = {
    Float8Drift.WARN: "training on in FP8 (train.float8_on_drift='warn')",
    Float8Drift.FALLBACK: (
        "applied; the run computes in high precision from here on, its resumes too "
        f"(train.float8_on_drift='fallback'); {FLOAT8_OFF} says so in the config"
    ),
    Float8Drift.STOP: "not applied; the run ends (train.float8_on_drift='stop')",
}


def fallback_kept_line(step: int) -> str:
    """The start of a resumed run whose FP8 fell back to high precision before."""
    return (
        f"FP8 fell back to high precision at step {step} (train.float8_on_drift='fallback'): "
        f"this launch computes in high precision too, as the run would have; {FLOAT8_OFF} "
        "says so in the config"
    )


def drift_line(step: int, verdict: Float8Verdict) -> str:
    """The line for an FP8 step that drifted from its high-precision recomputation."""
    assert verdict.action is not None
    return (
        f"step {step} in FP8 drifted from its high-precision recomputation: loss by "
        f"{verdict.loss_drift:.2%}, gradient norm by {verdict.grad_norm_drift:.2%} (past "
        "train.float8_check_tolerance or float8_check_grad_tolerance): "
        f"{DRIFT_HANDLING[verdict.action]}"
    )


class FaultReport(Hooks):
    """Prints the spike, replay and FP8 drift lines of each step on rank 0 (every rank knows
    them: the spike rule reads the loss over every rank, the verdicts are agreed), and the
    line of a step not finite on some rank (the control word's agreed verdict, counted in the
    loop state)."""

    def __init__(
        self,
        is_main: bool,
        hosts: Sequence[str],
        spike_policy: SpikePolicy,
        stream: TextIO | None = None,
        nonfinite_policy: NonFinitePolicy = NonFinitePolicy.SKIP,
    ) -> None:
        self.is_main = is_main
        self.hosts = tuple(hosts)
        self.spike_policy = spike_policy
        self.stream = stream
        self.nonfinite_policy = nonfinite_policy
        self.nonfinite_seen = 0  # the run's count of non-finite steps at the last step's end

    def on_train_begin(self, state: LoopState) -> None:
        self.nonfinite_seen = state.nonfinite_steps

    def on_step_end(self, state: LoopState, result: StepResult) -> None:
        """A step dropped as not finite: its line (``failed_at`` is its number, also after
        a rollback has taken the step counter back)."""
        dropped = state.nonfinite_steps > self.nonfinite_seen
        self.nonfinite_seen = state.nonfinite_steps
        if not (dropped and self.is_main and state.failed_at is not None):
            return
        line = nonfinite_line(state.failed_at, self.nonfinite_policy)
        if line is not None:
            print(f"[forge] warning: {line}", file=self.stream or sys.stderr, flush=True)

    def lines(self, step: int, result: StepResult) -> list[str]:
        """What step ``step`` revealed, as ``[forge]`` lines."""
        out = []
        if result.spike and result.world_loss is not None:
            out.append(f"warning: {spike_line(step, result.world_loss, self.spike_policy)}")
        verdict = result.replay
        if verdict is not None and not verdict.compared:
            out.append(f"warning: {uncompared_line(step, verdict)}")
        if verdict is not None and verdict.inconsistent:
            out.append(f"error: {inconsistent_line(step, verdict, self.hosts)}")
        if verdict is not None and verdict.diverged:
            out.append(f"error: {diverged_line(step, verdict, self.hosts)}")
        if verdict is not None and verdict.mismatched and not verdict.failed:
            out.append(f"warning: {outvoted_line(step, verdict, self.hosts)}")
        drift = result.float8
        if drift is not None and drift.action is not None:
            level = "error" if drift.stops else "warning"
            out.append(f"{level}: {drift_line(step, drift)}")
        return out

    def on_before_optimizer_step(
        self, state: PendingStep, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.is_main:
            return
        for line in self.lines(state.step, state.result):
            print(f"[forge] {line}", file=self.stream or sys.stderr, flush=True)
