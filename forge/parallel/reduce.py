"""Host values summed over every rank of the default group, and a logged step's metrics
reduced in one collective."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as torch_dist

from forge.metrics.reduction import Recorded, packed, unpacked


def sum_over_ranks(
    values: list[float], world_size: int, device: torch.device | str = "cpu"
) -> list[float]:
    """Element-wise sums of ``values`` over every rank (as is, for one process). ``device``:
    where the default group's backend reduces (the training device: NCCL takes no CPU
    tensors)."""
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t)
    return t.tolist()


def reduce_metrics(
    metrics: Sequence[Recorded],
    world_size: int,
    rank: int,
    slices: int,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """The record of ``metrics`` (recorded on every rank, in the same order) over the whole
    run, in one collective: ``forge.metrics.reduction`` packs them into one sum. ``slices``:
    the ranks that hold distinct tokens."""
    sums = sum_over_ranks(packed(metrics, world_size, rank), world_size, device)
    return unpacked(metrics, sums, world_size, slices)
