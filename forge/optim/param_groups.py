"""AdamW parameter groups: which parameters get weight decay."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forge.config.sections import OptimizerConfig


def decays(name: str, param: torch.Tensor, decay_embeddings: bool) -> bool:
    """Matrices decay; norms, biases (any 1-D tensor) and, unless switched on, embeddings do not."""
    if param.ndim < 2:
        return False
    return decay_embeddings or "embeddings" not in name


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict[str, Any]]:
    """Two groups, decay and no-decay, each listing its parameter names for inspection."""
    groups: dict[bool, dict[str, Any]] = {
        True: {"params": [], "names": [], "weight_decay": cfg.weight_decay},
        False: {"params": [], "names": [], "weight_decay": 0.0},
    }
    for name, p in model.named_parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        group = groups[decays(name, p, cfg.decay_embeddings)]
        group["params"].append(p)
        group["names"].append(name)
    return [g for g in groups.values() if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over ``param_groups``; the LR is set per step from the schedule."""
    groups = param_groups(model, cfg)
    for g in groups:
        del g["names"]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)
