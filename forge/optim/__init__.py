"""Optimizers, parameter groups and LR schedules."""

from forge.optim.param_groups import build_optimizer, param_groups
from forge.optim.schedules import Schedule, lr_at, lr_multiplier, resolve_schedule

__all__ = [
    "Schedule",
    "build_optimizer",
    "lr_at",
    "lr_multiplier",
    "param_groups",
    "resolve_schedule",
]
