"""``[resilience]``: non-finite steps, preemption and health."""

from __future__ import annotations

import enum

import attrs

from forge.config.ranges import Problem, non_negative, positive


class NonFinitePolicy(enum.Enum):
    """What the loop does with a step whose loss or grad norm is not finite."""

    SKIP = "skip"  # drop the update and go on
    ROLLBACK = "rollback"  # restore the last in-memory snapshot, skip the failing batches
    ABORT = "abort"  # end the run at the first


@attrs.frozen
class ResilienceConfig:
    """Non-finite steps, preemption and health.

    ``on_nonfinite``: ``skip`` drops the update, ``rollback`` restores the in-memory snapshot
    taken every ``snapshot_interval`` steps, ``abort`` ends the run at the first; after
    ``max_consecutive_nonfinite`` in a row the run ends NAN_ABORT. ``health_timeout_s`` bounds
    the per-step control-word exchange and the liveness check run every
    ``health_check_interval`` steps (0: off). ``shutdown_timeout_s``: after a preemption
    signal, the process exits anyway if the emergency save has not finished by then.
    """

    on_nonfinite: NonFinitePolicy = NonFinitePolicy.SKIP
    max_consecutive_nonfinite: int = 3
    snapshot_interval: int = 50
    health_check_interval: int = 100
    health_timeout_s: float = 300.0
    shutdown_timeout_s: float = 600.0

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        positive(p, "resilience.max_consecutive_nonfinite", self.max_consecutive_nonfinite)
        positive(p, "resilience.snapshot_interval", self.snapshot_interval)
        non_negative(p, "resilience.health_check_interval", self.health_check_interval)
        positive(p, "resilience.health_timeout_s", self.health_timeout_s)
        positive(p, "resilience.shutdown_timeout_s", self.shutdown_timeout_s)
        return p
