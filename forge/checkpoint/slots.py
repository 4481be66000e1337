"""Named in-memory snapshots of model + optimizer state.

Used for NaN rollback without touching the disk. A slot holds clones (state dicts gathered from
a live model share memory with it), plain tensors on the CPU; sharded (DTensor) state stays a
DTensor, each rank keeping its own shards. Loading clones again, so the optimizer's in-place
updates can never reach back into a slot.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map


def _clone(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


class Slots:
    """``push(name)`` snapshots, ``load(name)`` restores in place, ``pop(name)`` forgets."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self._slots: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def push(self, name: str) -> None:
        """Snapshot the current model and optimizer state into slot ``name`` (replacing it)."""
        model_sd = tree_map(_clone, self.model.state_dict())
        optim_sd = tree_map(_clone, self.optimizer.state_dict())
        self._slots[name] = (model_sd, optim_sd)

    @torch.no_grad()
    def load(self, name: str) -> None:
        """Restore slot ``name`` into the live model and optimizer (moments and step counts too;
        a snapshot taken before the first step empties the optimizer state)."""
        model_sd, optim_sd = self._slots[name]
        self.model.load_state_dict(tree_map(_clone, model_sd))
        self.optimizer.load_state_dict(tree_map(_clone, optim_sd))

    def pop(self, name: str) -> None:
        """Forget slot ``name``."""
        del self._slots[name]
