"""Host values summed or averaged over every rank of the default group."""

from __future__ import annotations

import torch
import torch.distributed as torch_dist


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


def mean_over_ranks(value: float, world_size: int, device: torch.device | str = "cpu") -> float:
    """The mean of ``value`` over every rank (a no-op for one process).

    Ranks that share a data slice (TP peers) hold the same value, so the mean over the world
    equals the mean over data-parallel ranks.
    """
    if world_size == 1:
        return value
    return sum_over_ranks([value], world_size, device)[0] / world_size
