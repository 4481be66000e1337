"""Parameter groups (which parameters decay, which Muon updates) and the optimizer from config."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from forge.config.sections import OptimizerConfig, OptimizerName
from forge.optim.optimizers import Lion, MuonAdamW, ScheduleFreeAdamW


def decays(name: str, param: torch.Tensor, decay_embeddings: bool) -> bool:
    """Matrices decay; norms, biases (any 1-D tensor) and, unless switched on, embeddings do not."""
    if param.ndim < 2:
        return False
    return decay_embeddings or "embeddings" not in name


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """Muon takes the hidden matrices: 2-D weights inside the blocks and the multi-token
    depths (not the embedding or the output head, whose rows are tokens)."""
    return param.ndim == 2 and name.startswith(("layers.", "mtp."))


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict[str, Any]]:
    """Decay and no-decay groups (and, for Muon, a Muon group of hidden matrices, which
    decay) of the trainable parameters, each listing its parameter names for inspection."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return groups_of(trainable, cfg)  # tied weights appear once


def groups_of(
    named: Iterable[tuple[str, torch.Tensor]], cfg: OptimizerConfig
) -> list[dict[str, Any]]:
    """``param_groups`` of the given ``(name, parameter)`` pairs (a freeze schedule adds the
    newly trainable ones as groups of their own)."""
    muon = cfg.name is OptimizerName.MUON
    groups: dict[tuple[bool, bool], dict[str, Any]] = {
        (True, True): {"params": [], "names": [], "weight_decay": cfg.weight_decay},
        (False, True): {"params": [], "names": [], "weight_decay": cfg.weight_decay},
        (False, False): {"params": [], "names": [], "weight_decay": 0.0},
    }
    for name, p in named:
        on_muon = muon and uses_muon(name, p)
        group = groups[(on_muon, on_muon or decays(name, p, cfg.decay_embeddings))]
        group["params"].append(p)
        group["names"].append(name)
    if muon:
        groups[(True, True)]["use_muon"] = True
    return [g for g in groups.values() if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The configured optimizer over ``param_groups``; the LR is set per step from the
    schedule."""
    groups = param_groups(model, cfg)
    for g in groups:
        del g["names"]
    if cfg.name is OptimizerName.LION:
        return Lion(groups, lr=cfg.lr, betas=cfg.betas)
    if cfg.name is OptimizerName.SCHEDULE_FREE_ADAMW:
        return ScheduleFreeAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    if cfg.name is OptimizerName.MUON:
        return MuonAdamW(
            groups,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            momentum=cfg.momentum,
            ns_steps=cfg.ns_steps,
        )
    # fused kernels: one launch for all parameters on CUDA; on CPU one vectorised pass per
    # tensor, 5-7x faster than foreach for the debug model (benchmarks/precision.py). They
    # take no mix of DTensors and plain tensors (tensor parallelism without FSDP2 keeps a
    # mixture-of-experts block's experts plain): then one parameter at a time
    fused = {"fused": True} if uniform_tensors(groups) else {"foreach": False}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **fused)


def uniform_tensors(groups: Iterable[dict[str, Any]]) -> bool:
    """Whether the parameters are all ``DTensor``s or all plain tensors."""
    kinds = {isinstance(p, DTensor) for g in groups for p in g["params"]}
    return len(kinds) <= 1


def inference_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer | None:
    """The optimizer a script must load beside the weights to evaluate or export them:
    Schedule-Free's averaged weights live partly in its state. None for the others."""
    if cfg.name is OptimizerName.SCHEDULE_FREE_ADAMW:
        return build_optimizer(model, cfg)
    return None
