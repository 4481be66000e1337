"""Auxiliary-loss-free load balancing (DeepSeek-V3): after each applied optimizer step, every
sigmoid router's per-expert bias moves toward the experts that got fewer tokens than average.

The bias only changes which experts are chosen, never their weights, so it needs no gradient;
it is a buffer, saved in checkpoints with the weights. The update is an effect of the step
(``finish_step`` in ``forge.training.steps.common`` calls ``balance_experts`` right after
``optimizer.step()``), never part of ``forward``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from forge.model.moe import MoE


def bias_update(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """The next bias: ``bias + rate × sign(mean load − load)`` per expert (an expert with
    exactly the mean load keeps its bias)."""
    return bias + rate * torch.sign(loads.float().mean() - loads.float())


def global_loads(loads: torch.Tensor, world_size: int) -> torch.Tensor:
    """The step's loads summed over every rank (ranks that share a batch, such as pipeline
    or tensor peers, scale every expert alike, which the sign of the update ignores)."""
    if world_size == 1:
        return loads
    total = loads.clone()
    dist.all_reduce(total)
    return total


@torch.no_grad()
def balance_experts(model: nn.Module, loads: torch.Tensor, rate: float) -> None:
    """Apply ``bias_update`` to the router of every MoE layer this model (or pipeline stage)
    holds; ``loads`` ``(MoE layers, E)`` is indexed by each layer's position among them."""
    for module in model.modules():
        if isinstance(module, MoE):
            bias = module.router.expert_bias
            bias.copy_(bias_update(bias, loads[module.layer].to(bias.device), rate))
