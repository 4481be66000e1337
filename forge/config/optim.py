"""``[optimizer]`` and ``[scheduler]``: the update rule and the LR schedule."""

from __future__ import annotations

import enum

import attrs

from forge.config.ranges import Problem, non_negative, positive


class OptimizerName(enum.Enum):
    ADAMW = "adamw"
    MUON = "muon"  # Muon for the 2-D hidden matrices, AdamW for embeddings, head, norms
    LION = "lion"
    SCHEDULE_FREE_ADAMW = "schedule_free_adamw"  # evaluates the averaged weights


class ScheduleName(enum.Enum):
    """LR schedule shapes. Each but ``none`` has a linear warmup of ``warmup_steps`` in front."""

    COSINE = "cosine"
    LINEAR = "linear"
    REX = "rex"  # (1 - p) / (1 - p / 2) over the decay: REX, Chen et al. 2021
    WSD = "wsd"
    CONSTANT = "constant"  # warmup, then the peak LR
    NONE = "none"  # the peak LR from the first step: no warmup (warmup_steps is ignored)


@attrs.frozen
class OptimizerConfig:
    """The update rule, with explicit param groups: norms and biases never decay; embeddings by
    switch. ``betas`` serve AdamW (and Muon's AdamW part) and Lion; ``momentum`` and
    ``ns_steps`` serve Muon."""

    name: OptimizerName = OptimizerName.ADAMW
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_embeddings: bool = False
    momentum: float = 0.95  # Muon's momentum (Nesterov)
    ns_steps: int = 5  # Muon's Newton–Schulz iterations

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        positive(p, "optimizer.lr", self.lr)
        non_negative(p, "optimizer.weight_decay", self.weight_decay)
        positive(p, "optimizer.eps", self.eps)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            p.append(("optimizer.betas", f"each beta must be in [0, 1), got {list(self.betas)}"))
        if not 0.0 <= self.momentum < 1.0:
            p.append(("optimizer.momentum", f"must be in [0, 1), got {self.momentum}"))
        positive(p, "optimizer.ns_steps", self.ns_steps)
        return p


@attrs.frozen
class SchedulerConfig:
    """LR schedule as a pure function of the step. ``decay_steps`` is the length of the decay
    (cosine, linear: from the end of warmup; wsd: the final tail). None: up to max_steps."""

    name: ScheduleName = ScheduleName.COSINE
    warmup_steps: int = 100
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        non_negative(p, "scheduler.warmup_steps", self.warmup_steps)
        if self.decay_steps is not None:
            positive(p, "scheduler.decay_steps", self.decay_steps)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            p.append(("scheduler.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}"))
        return p
