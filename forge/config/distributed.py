"""``[distributed]``: how the world is split into a device mesh, and the pipeline's schedule."""

from __future__ import annotations

import enum

import attrs

from forge.config.ranges import Problem, positive, timeout_range


class PipelineSchedule(enum.Enum):
    """The schedules of ``torch.distributed.pipelining`` forge runs (docs/distributed.md)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


# a process group's start-up and its collectives between processes of one machine take
# this long: a shorter timeout fails healthy runs (0.001 s did, at the rendezvous)
MIN_TIMEOUT_S = 1.0


@attrs.frozen
class DistributedConfig:
    """How the world is split. Dims of size 1 are dropped from the mesh; ``dp_shard = -1``
    takes whatever the other dims leave of the world size. Under ``pp > 1`` each rank holds
    ``pp_stages_per_rank`` stages; ``pp_stage_boundaries`` (the layer where each stage after
    the first begins) replaces the split balanced by parameter count."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism, carved out of dp_shard (docs/moe.md)
    cp: int = 1  # context parallelism: each sequence split over cp ranks (docs/distributed.md)
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    pp_stages_per_rank: int = 1  # virtual stages per pipeline rank
    pp_stage_boundaries: tuple[int, ...] = ()  # empty: balanced by parameter count
    backend: str = "cpu:gloo,cuda:nccl"
    timeout_s: float = 600.0  # process-group init and every collective

    @property
    def n_stages(self) -> int:
        """Pipeline stages over all ranks."""
        return self.pp * self.pp_stages_per_rank

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for key in ("dp_replicate", "tp", "pp", "ep", "cp", "pp_stages_per_rank"):
            positive(p, f"distributed.{key}", getattr(self, key))
        if self.dp_shard != -1 and self.dp_shard < 1:
            p.append(
                ("distributed.dp_shard", f"must be -1 (the rest) or >= 1, got {self.dp_shard}")
            )
        why = "process-group start-up and every collective must fit in it"
        timeout_range(p, "distributed.timeout_s", self.timeout_s, MIN_TIMEOUT_S, why)
        return p
