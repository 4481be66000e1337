"""Step functions: one optimizer step over one step's micro-batches, behind the ``StepFn`` seam."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from forge.config.sections import Precision
from forge.data.loader import Batch
from forge.optim.schedules import Schedule, lr_at
from forge.training.state import LoopState, StepResult


def autocast_for(precision: Precision) -> Callable[[], contextlib.AbstractContextManager]:
    """A context-manager factory for the compute dtype (parameters stay fp32)."""
    if precision is Precision.BF16:
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def lm_loss(model: nn.Module, batch: Batch, autocast: Callable) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch, computed in fp32."""
    with autocast():
        logits = model(batch.inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten())


def make_text_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    peak_lr: float,
    precision: Precision,
    grad_clip_norm: float | None,
) -> Callable[[tuple[Batch, ...], LoopState], StepResult]:
    """The language-model step: accumulate gradients, clip, and update only if all is finite.

    One host sync per step (loss and grad norm together); the finiteness check comes before
    ``optimizer.step()`` so a non-finite step never touches the optimizer state.
    """
    autocast = autocast_for(precision)
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = math.inf if grad_clip_norm is None else grad_clip_norm

    def text_step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        lr = lr_at(schedule, peak_lr, state.step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        total = torch.zeros(())
        for batch in batches:
            loss = lm_loss(model, batch, autocast)
            (loss / len(batches)).backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        loss_value, norm_value = torch.stack([total / len(batches), grad_norm]).tolist()
        if math.isfinite(loss_value) and math.isfinite(norm_value):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return StepResult(
            loss=loss_value,
            grad_norm=norm_value,
            tokens=sum(b.num_tokens for b in batches),
            lr=lr,
        )

    return text_step


@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: list[Batch], precision: Precision) -> float:
    """Mean loss over ``batches`` (each the same size), in eval mode."""
    autocast = autocast_for(precision)
    was_training = model.training
    model.eval()
    total = torch.zeros(())
    for batch in batches:
        total += lm_loss(model, batch, autocast)
    model.train(was_training)
    return float(total / max(1, len(batches)))
