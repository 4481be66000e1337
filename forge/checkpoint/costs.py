"""What checkpoints cost a run, as metrics: each save's time the loop was held and until its
commit, and its bytes; each resume's load and verification time (the longest over ranks)."""

from __future__ import annotations

import attrs


@attrs.frozen
class SaveCost:
    """What a committed save cost: the longest any rank's caller was held by it (``save``,
    and the ``wait`` that committed it), the longest until its commit from the save's start
    (off the loop in the async modes), and the bytes of the files every rank wrote (tensors,
    metadata, RNG state; the train state's few KB, written by the commit, aside)."""

    step: int
    blocked_s: float
    commit_s: float
    bytes: int

    def record(self) -> dict[str, float | int]:
        """The metrics record of this save."""
        return {
            "step": self.step,
            "checkpoint/blocked_s": self.blocked_s,
            "checkpoint/commit_s": self.commit_s,
            "checkpoint/bytes": self.bytes,
        }


@attrs.frozen
class ResumeCost:
    """What a resume cost: the longest any rank took to load the checkpoint's tensors, and to
    verify its bytes (every candidate tried, a damaged one that gave way included)."""

    load_s: float
    verify_s: float

    def record(self, step: int) -> dict[str, float | int]:
        """The metrics record of a resume at ``step``."""
        return {
            "step": step,
            "checkpoint/load_s": self.load_s,
            "checkpoint/verify_s": self.verify_s,
        }
