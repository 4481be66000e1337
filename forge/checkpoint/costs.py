"""What checkpoints cost a run, as metrics carried in the next logged step's record (the
longest over ranks, in that record's one reduction): each save's time the loop was held and
until its commit, and its bytes; each resume's load and verification time."""

from __future__ import annotations

import attrs

from forge.metrics.reduction import Recorded, Reduction, recorded_value


def as_int(values: tuple[float, ...]) -> int:
    return int(values[0])


@attrs.frozen
class SaveCost:
    """What a committed save cost this rank: how long its caller was held (``save``, and the
    ``wait`` that committed it), how long until the commit from the save's start (off the
    loop in the async modes), and the bytes of every rank's files (tensors, metadata, RNG
    states; the train state's few KB, written by the commit, aside)."""

    step: int
    blocked_s: float
    commit_s: float
    bytes: int

    def recorded(self) -> list[Recorded]:
        return [
            recorded_value("checkpoint/step", self.step, Reduction.MAX, as_int),
            recorded_value("checkpoint/blocked_s", self.blocked_s, Reduction.MAX),
            recorded_value("checkpoint/commit_s", self.commit_s, Reduction.MAX),
            recorded_value("checkpoint/bytes", self.bytes, Reduction.MAX, as_int),
        ]


@attrs.frozen
class ResumeCost:
    """What a resume cost this rank: the time to load the checkpoint's tensors, and to verify
    its bytes (every candidate tried, one that gave way to an older one included)."""

    load_s: float
    verify_s: float

    def recorded(self) -> list[Recorded]:
        return [
            recorded_value("checkpoint/load_s", self.load_s, Reduction.MAX),
            recorded_value("checkpoint/verify_s", self.verify_s, Reduction.MAX),
        ]
