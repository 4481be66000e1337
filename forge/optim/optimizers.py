"""Lion, Muon for the hidden matrices with AdamW for the rest, and Schedule-Free AdamW, as
``torch.optim.Optimizer``s.

All work on plain tensors and on sharded ``DTensor`` parameters (FSDP2, TP). Lion's update is
elementwise, so each shard updates itself. Muon orthogonalises each matrix's momentum with a
Newton–Schulz iteration, which needs the whole matrix: under sharding each matrix has one owner
rank that gathers it, iterates and sends every rank its shard of the result
(``forge.optim.muon_dist``), so the ranks share the work and a sharded run takes exactly the
steps of a one-process run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from forge.optim.muon_dist import (
    NS_COEFFICIENTS,
    newton_schulz,
    orthogonalize_all,
    orthogonalized,
)

__all__ = [
    "NS_COEFFICIENTS",
    "Lion",
    "MuonAdamW",
    "ScheduleFreeAdamW",
    "evaluation_weights",
    "muon_lr_scale",
    "newton_schulz",
    "orthogonalized",
]


def muon_lr_scale(shape: torch.Size) -> float:
    """Moonshot's scale: Muon's update gets AdamW's RMS, so both share ``optimizer.lr``."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): ``p -= lr * (sign(b1 m + (1 - b1) g) + wd p)``, then
    ``m = b2 m + (1 - b2) g``. One state tensor per parameter."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Lion update of every parameter with a gradient."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                direction = m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(direction, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """Muon (momentum, Nesterov, Newton–Schulz orthogonalisation) for the groups marked
    ``use_muon``, AdamW for the others: one optimizer object to the loop, one state dict.

    Sharded matrices are orthogonalised owner-computes (``muon_dist.orthogonalize_all``):
    each rank iterates on its share of the matrices. ``distributed_ns=False`` keeps the
    gather-everything path (every rank iterates on every matrix), the benchmark's baseline;
    both give the same steps and the same state (``momentum_buffer`` per matrix)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
        distributed_ns: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "ns_steps": ns_steps,
            "use_muon": False,
        }
        super().__init__(params, defaults)
        # an attribute, not a default: the param groups (and so checkpoints) stay as they were
        self.distributed_ns = distributed_ns

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update: Muon for ``use_muon`` groups, AdamW for the rest."""
        loss = closure() if closure is not None else None
        muon: list[tuple[torch.Tensor, dict[str, Any]]] = []
        updates: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:  # the same parameters on every rank: FSDP2 and TP agree
                    continue
                if group["use_muon"]:  # state made in parameter order, as before
                    muon.append((p, group))
                    updates.append(self._nesterov(p, group))
                else:
                    self._adamw(p, group)
        steps = [group["ns_steps"] for _, group in muon]
        # all matrices at once, so the sharded ones travel in a few batched collectives
        orthos = orthogonalize_all(updates, steps, distributed=self.distributed_ns)
        for (p, group), ortho in zip(muon, orthos, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(ortho, alpha=-group["lr"] * muon_lr_scale(p.shape))
        return loss

    def _nesterov(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance ``p``'s momentum buffer; the Nesterov update to orthogonalise."""
        grad = p.grad
        assert grad is not None
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"])

    def _adamw(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = int(state["step"].item())  # a CPU counter: no device sync
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Schedule-Free AdamW (Defazio et al. 2024): no decay schedule needed.

    The parameters hold ``y``, where gradients are taken; the state holds the base sequence
    ``z``; the weights to evaluate, export and sample from are the averaged iterate
    ``x = y + (1 - 1/b1)(z - y)`` (``averaged``), weighted by the squared peak LR so far.
    Use it with a warmup and a constant LR (``scheduler.name = "constant"``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "k": 0,  # steps taken
            "lr_max": 0.0,
            "weight_sum": 0.0,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Schedule-Free step: ``z`` takes the AdamW direction, ``y`` moves between the
        new average and ``z``."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, k = group["lr"], group["k"]
            group["lr_max"] = max(lr, group["lr_max"])
            weight = group["lr_max"] ** 2
            group["weight_sum"] += weight
            ckp1 = weight / group["weight_sum"] if group["weight_sum"] else 0.0
            bias_correction2 = 1 - beta2 ** (k + 1)
            y_lr = lr * (beta1 * (1 - ckp1) - 1)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["z"] = p.detach().clone()
                    state["exp_avg_sq"] = torch.zeros_like(p)
                v, z = state["exp_avg_sq"], state["z"]
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                direction = p.grad / (v / bias_correction2).sqrt_().add_(group["eps"])
                direction.add_(p, alpha=group["weight_decay"])  # decay taken at y
                p.lerp_(z, ckp1)
                p.add_(direction, alpha=y_lr)
                z.sub_(direction, alpha=lr)
            group["k"] = k + 1
        return loss

    @torch.no_grad()
    def averaged(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, x)`` for every parameter with state: the evaluation weights."""
        pairs = []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                if "z" in self.state[p]:
                    pairs.append((p, p.lerp(self.state[p]["z"], 1 - 1 / beta1)))
        return pairs


@contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Inside the block the parameters hold the optimizer's evaluation weights (Schedule-Free's
    averaged iterate); after it, exactly their training values again (copied back, so a run
    that evaluates resumes bit for bit). Other optimizers (or None): nothing changes."""
    if not isinstance(optimizer, ScheduleFreeAdamW):
        yield
        return
    pairs = optimizer.averaged()
    training = [p.detach().clone() for p, _ in pairs]
    with torch.no_grad():
        for p, x in pairs:
            p.copy_(x)
    try:
        yield
    finally:
        with torch.no_grad():
            for (p, _), y in zip(pairs, training, strict=True):
                p.copy_(y)
