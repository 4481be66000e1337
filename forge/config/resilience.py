"""``[resilience]``: non-finite steps, loss spikes, replayed steps, stragglers, preemption and
health."""

from __future__ import annotations

import enum

import attrs

from forge.config.ranges import Problem, non_negative, positive, timeout_range

# the control word waits for the slowest rank's step and rank 0's logging: under a second it
# times out on healthy ranks, and every run ends HEALTH_FAILURE at step 1
MIN_HEALTH_TIMEOUT_S = 1.0
MIN_SHUTDOWN_TIMEOUT_S = 1.0


class NonFinitePolicy(enum.Enum):
    """What the loop does with a step whose loss or grad norm is not finite."""

    SKIP = "skip"  # drop the update and go on
    ROLLBACK = "rollback"  # restore the last in-memory snapshot, skip the failing batches
    ABORT = "abort"  # end the run at the first


class SpikePolicy(enum.Enum):
    """What the loop does with a finite step whose loss is a spike (``spike_threshold``)."""

    WARN = "warn"  # train on it, count it and say so
    SKIP = "skip"  # drop the update and go on, as for a non-finite step
    ROLLBACK = "rollback"  # restore the last in-memory snapshot, skip the batches since


@attrs.frozen
class ResilienceConfig:
    """Non-finite steps, loss spikes, replayed steps, stragglers, preemption and health.

    ``on_nonfinite``: ``skip`` drops the update, ``rollback`` restores the in-memory snapshot
    taken every ``snapshot_interval`` steps, ``abort`` ends the run at the first; after
    ``max_consecutive_nonfinite`` in a row the run ends NAN_ABORT. ``health_timeout_s`` bounds
    the per-step control-word exchange and the liveness check run every
    ``health_check_interval`` steps (0: off). ``shutdown_timeout_s``: after a preemption
    signal, the process exits anyway if the emergency save has not finished by then.

    ``spike_threshold``: a finite loss more than this many deviations above the running mean
    is a spike (0: off), handled by ``on_spike``; those skipped count toward
    ``max_consecutive_nonfinite`` as non-finite ones do. ``replay_interval``: every this many
    steps (0: off) each rank computes the step twice and compares the results bitwise, a third
    time to outvote a mismatch (``replay_first_step``: also the first step of every launch).
    ``straggler_ratio``: a rank whose own time per step stays this many times the median for
    ``straggler_logs`` logged steps in a row is named in a warning.
    """

    on_nonfinite: NonFinitePolicy = NonFinitePolicy.SKIP
    max_consecutive_nonfinite: int = 3
    snapshot_interval: int = 50
    health_check_interval: int = 100
    health_timeout_s: float = 300.0
    shutdown_timeout_s: float = 600.0
    spike_threshold: float = 0.0
    on_spike: SpikePolicy = SpikePolicy.WARN
    replay_interval: int = 0
    replay_first_step: bool = True
    straggler_ratio: float = 1.5
    straggler_logs: int = 3

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        positive(p, "resilience.max_consecutive_nonfinite", self.max_consecutive_nonfinite)
        positive(p, "resilience.snapshot_interval", self.snapshot_interval)
        non_negative(p, "resilience.health_check_interval", self.health_check_interval)
        timeout_range(
            p, "resilience.health_timeout_s", self.health_timeout_s, MIN_HEALTH_TIMEOUT_S,
            "the per-step control word waits that long for the slowest rank's step, so a "
            "shorter one fails healthy runs; it bounds how long a dead peer goes unnoticed",
        )  # fmt: skip
        timeout_range(
            p, "resilience.shutdown_timeout_s", self.shutdown_timeout_s, MIN_SHUTDOWN_TIMEOUT_S,
            "the rest of the step and the emergency save must fit in it",
        )  # fmt: skip
        non_negative(p, "resilience.spike_threshold", self.spike_threshold)
        non_negative(p, "resilience.replay_interval", self.replay_interval)
        if not self.straggler_ratio > 1:  # NaN included
            p.append(
                (
                    "resilience.straggler_ratio",
                    f"must be > 1 (the slowest rank's time over the median's), "
                    f"got {self.straggler_ratio}",
                )
            )
        positive(p, "resilience.straggler_logs", self.straggler_logs)
        return p
