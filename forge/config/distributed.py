"""``[distributed]``: how the world is split into a device mesh."""

from __future__ import annotations

import enum

import attrs

from forge.config.ranges import Problem, positive


class PipelineSchedule(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


@attrs.frozen
class DistributedConfig:
    """How the world is split. Dims of size 1 are dropped from the mesh; ``dp_shard = -1``
    takes whatever the other dims leave of the world size."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism, carved out of dp_shard (docs/moe.md)
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    backend: str = "cpu:gloo,cuda:nccl"
    timeout_s: float = 600.0  # process-group init and every collective

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for key in ("dp_replicate", "tp", "pp", "ep"):
            positive(p, f"distributed.{key}", getattr(self, key))
        if self.dp_shard != -1 and self.dp_shard < 1:
            p.append(
                ("distributed.dp_shard", f"must be -1 (the rest) or >= 1, got {self.dp_shard}")
            )
        positive(p, "distributed.timeout_s", self.timeout_s)
        return p
