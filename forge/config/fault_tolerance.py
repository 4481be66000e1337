"""``[fault_tolerance]``: replica groups that keep training when one dies and heal it from a
live peer (torchft; docs/fault-tolerance.md)."""

from __future__ import annotations

import attrs

from forge.config.ranges import Problem, positive, timeout_range

# torchft's RPCs and the cross-group sums between processes: shorter fails healthy steps
MIN_TIMEOUT_S = 1.0


@attrs.frozen
class FaultToleranceConfig:
    """In-job recovery over ``groups`` replica groups, each an ordinary forge launch (any
    layout inside it, the same in every group) whose gradients are summed over the groups
    that take part in a step; a step commits only when torchft's manager says so.

    ``lighthouse``: the torchft lighthouse's address (``http://host:port``; empty: the
    ``TORCHFT_LIGHTHOUSE`` variable). ``group``: this launch's index in ``[0, groups)``.
    ``min_groups``: a step commits only when at least this many groups took part.
    ``timeout_s``: the cross-group collectives, the commit and a heal's transfer;
    ``quorum_timeout_s``: how long a step waits for its quorum (a lost lighthouse ends the run
    after it); ``heartbeat_ms``: how often the group tells the lighthouse it is alive.
    """

    enabled: bool = False
    lighthouse: str = ""
    group: int = 0
    groups: int = 1
    min_groups: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    heartbeat_ms: int = 100

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        positive(p, "fault_tolerance.groups", self.groups)
        positive(p, "fault_tolerance.min_groups", self.min_groups)
        why = "a healthy step's sums, commit and quorum take that long between processes"
        for key in ("timeout_s", "quorum_timeout_s"):
            timeout_range(p, f"fault_tolerance.{key}", getattr(self, key), MIN_TIMEOUT_S, why)
        positive(p, "fault_tolerance.heartbeat_ms", self.heartbeat_ms)
        if self.groups >= 1 and not 0 <= self.group < self.groups:
            p.append(
                (
                    "fault_tolerance.group",
                    f"must be in [0, fault_tolerance.groups={self.groups}), got {self.group}",
                )
            )
        if self.min_groups > self.groups >= 1:
            p.append(
                (
                    "fault_tolerance.min_groups",
                    f"must be <= fault_tolerance.groups={self.groups}, got {self.min_groups}",
                )
            )
        if self.lighthouse and not self.lighthouse.startswith(("http://", "https://")):
            p.append(
                (
                    "fault_tolerance.lighthouse",
                    f"must be an address like http://host:29510, got {self.lighthouse!r}",
                )
            )
        return p

    def unread_keys(self) -> list[Problem]:
        """The keys set off their defaults while ``enabled`` is false: refused at a launch (a
        group's keys on a plain run would train it as a whole run), not when a saved run's
        config is read back (eval, export)."""
        if self.enabled:
            return []
        return [
            (
                f"fault_tolerance.{name}",
                "is set, but fault_tolerance.enabled is false, so nothing reads it; set "
                "fault_tolerance.enabled = true for replica groups, or remove it",
            )
            for name, field in attrs.fields_dict(FaultToleranceConfig).items()
            if name != "enabled" and getattr(self, name) != field.default
        ]

    @property
    def active_groups(self) -> int:
        """The replica groups the global batch is split among (1 when off)."""
        return self.groups if self.enabled else 1
