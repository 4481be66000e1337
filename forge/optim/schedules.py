"""LR schedules as pure functions of the step: a multiplier in [0, 1] on the peak LR.

``step`` is the index of the optimizer step about to run (0 for the first). Warmup is linear
and reaches the peak at ``warmup_steps``; its first value is ``1 / (warmup_steps + 1)``, so the
first step never runs at LR 0. ``none`` has no warmup: the peak LR from step 0.
"""

from __future__ import annotations

import math

import attrs

from forge.config.sections import ScheduleName, SchedulerConfig


@attrs.frozen
class Schedule:
    """A resolved schedule: every length is known."""

    name: ScheduleName
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float
    total_steps: int


def resolve_schedule(cfg: SchedulerConfig, max_steps: int) -> Schedule:
    """Fill in ``decay_steps`` (None: the rest of the run after warmup; WSD: 20% of the run)."""
    if cfg.decay_steps is not None:
        decay = cfg.decay_steps
    elif cfg.name is ScheduleName.WSD:
        decay = max(1, max_steps // 5)
    else:
        decay = max(1, max_steps - cfg.warmup_steps)
    return Schedule(cfg.name, cfg.warmup_steps, decay, cfg.min_lr_ratio, max_steps)


def lr_multiplier(s: Schedule, step: int) -> float:
    """The LR multiplier for optimizer step ``step``."""
    if s.name is ScheduleName.NONE:
        return 1.0
    if step < s.warmup_steps:
        return (step + 1) / (s.warmup_steps + 1)
    floor = s.min_lr_ratio
    if s.name is ScheduleName.CONSTANT:
        return 1.0
    if s.name is ScheduleName.WSD:
        decay_start = s.total_steps - s.decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / s.decay_steps)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    progress = min(1.0, (step - s.warmup_steps) / s.decay_steps)
    if s.name is ScheduleName.LINEAR:
        return 1.0 - (1.0 - floor) * progress
    if s.name is ScheduleName.REX:
        return floor + (1.0 - floor) * (1.0 - progress) / (1.0 - progress / 2)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(s: Schedule, peak_lr: float, step: int) -> float:
    """Absolute learning rate for optimizer step ``step``."""
    return peak_lr * lr_multiplier(s, step)
