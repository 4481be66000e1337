"""The compute precision of a forward: bf16 autocast over fp32 parameters, or none, on the
device the model's parameters live on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from forge.config.sections import Precision


def autocast_for(
    precision: Precision, device_type: str = "cpu"
) -> Callable[[], contextlib.AbstractContextManager]:
    """A context-manager factory for the compute dtype (parameters stay fp32)."""
    if precision is Precision.BF16:
        return lambda: torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def device_type_of(model: nn.Module) -> str:
    """``cpu`` or ``cuda``: where the model's (local) parameters live."""
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"
