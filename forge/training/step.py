"""Step functions: one optimizer step over one step's micro-batches, behind the ``StepFn`` seam."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from forge.config.sections import Precision
from forge.data.loader import Batch
from forge.data.packing import IGNORE_INDEX
from forge.metrics.sources import SourceStats
from forge.optim.schedules import Schedule, lr_at
from forge.parallel.grad_norm import clip_coefficient, global_grad_norm, scale_grads_
from forge.parallel.pipeline import head_kwargs
from forge.training.context import PipelineContext
from forge.training.state import LoopState, StepResult


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


def logits_of(model: nn.Module, batch: Batch, autocast: Callable) -> torch.Tensor:
    """The model's fp32 logits for a micro-batch (packed rows pass positions and documents)."""
    with autocast():
        logits = model(batch.inputs, **document_kwargs(batch))
    return logits.float()


def document_kwargs(batch: Batch) -> dict[str, torch.Tensor | None]:
    """The model's keyword inputs for packed rows (per-token positions and documents)."""
    if batch.document_ids is None:
        return {}
    return {"positions": batch.positions, "document_ids": batch.document_ids}


def token_losses(
    model: nn.Module,
    batch: Batch,
    autocast: Callable,
    loss_chunk_size: int,
    *,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token fp32 cross-entropy ``(B, T)`` (0 where the label is ignored) and, when
    chunked or ``with_lse``, the per-token logsumexp.

    ``loss_chunk_size`` > 0: the model computes both chunk by chunk and the full logits never
    exist; 0: the plain path, fp32 logits then ``F.cross_entropy``.
    """
    if loss_chunk_size > 0:
        with autocast():
            return model(
                batch.inputs,
                labels=batch.labels,
                loss_chunk_size=loss_chunk_size,
                **document_kwargs(batch),
            )
    logits = logits_of(model, batch, autocast)
    ce = F.cross_entropy(logits.transpose(1, 2), batch.labels, reduction="none")
    return ce, logits.logsumexp(-1) if with_lse else None


def lm_loss(
    model: nn.Module,
    batch: Batch,
    autocast: Callable,
    stats: SourceStats | None = None,
    loss_chunk_size: int = 0,
) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch over its unmasked labels, in fp32.

    With ``stats``, also adds each row's loss sum and label count to its source's totals.
    """
    return lm_loss_and_z(model, batch, autocast, stats, loss_chunk_size, with_z=False)[0]


def lm_loss_and_z(
    model: nn.Module,
    batch: Batch,
    autocast: Callable,
    stats: SourceStats | None = None,
    loss_chunk_size: int = 0,
    *,
    with_z: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cross-entropy of ``lm_loss`` and (``with_z``) the z-loss term
    ``mean(logsumexp(logits)²)``, both over the unmasked labels."""
    per_token, lse = token_losses(model, batch, autocast, loss_chunk_size, with_lse=with_z)
    counted = batch.labels != IGNORE_INDEX
    if stats is not None and batch.sources is not None:
        stats.add(batch.sources, per_token.sum(dim=1), counted.sum(dim=1))
    n = counted.sum()
    z = (lse.square() * counted).sum() / n if with_z and lse is not None else None
    return per_token.sum() / n, z


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2: reduce-scatter gradients only on the last micro-batch of a step."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Set every param group's learning rate; returns it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def finish_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    max_norm: float,
    *,
    tokens: int,
    lr: float,
    z_loss: torch.Tensor | None = None,
) -> StepResult:
    """Clip by the global norm and step, only if loss, norm (and z-loss) are finite; report
    the step.

    Reads them in one host sync (one device-to-host copy of all). A non-finite step zeroes the
    gradients and never touches the optimizer state.
    """
    read = [loss.float(), grad_norm.float(), *([z_loss.float()] if z_loss is not None else [])]
    values = torch.stack(read).tolist()
    result = StepResult(
        loss=values[0],
        grad_norm=values[1],
        tokens=tokens,
        lr=lr,
        z_loss=values[2] if z_loss is not None else None,
    )
    if result.finite:
        if math.isfinite(max_norm):
            scale_grads_(params, clip_coefficient(result.grad_norm, max_norm))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return result


def make_text_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    peak_lr: float,
    precision: Precision,
    grad_clip_norm: float | None,
    *,
    fsdp_mixed_precision: bool = False,
    dp_size: int = 1,
    loss_scale: Callable[[int], float] | None = None,
    stats: SourceStats | None = None,
    z_loss_weight: float = 0.0,
    loss_chunk_size: int = 0,
) -> Callable[[tuple[Batch, ...], LoopState], StepResult]:
    """The language-model step: accumulate gradients, clip, and update only if all is finite.

    One host sync per step (loss and grad norm together); the finiteness check comes before
    ``optimizer.step()`` so a non-finite step never touches the optimizer state. The grad norm
    is global over every shard, so all ranks agree on whether the step is finite. The loss is
    this rank's; it is averaged over data-parallel ranks only when logged. ``loss_scale``
    (tests only) multiplies the loss of a given step, e.g. by NaN. ``stats`` collects
    per-source losses of a mixture. ``z_loss_weight`` > 0 adds ``weight × mean(logsumexp²)`` to
    the objective; the reported ``loss`` stays the cross-entropy, ``z_loss`` the mean term.
    ``loss_chunk_size`` > 0 computes the loss chunk by chunk (``token_losses``).
    """
    autocast = (
        contextlib.nullcontext
        if fsdp_mixed_precision
        else autocast_for(precision, device_type_of(model))
    )
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = math.inf if grad_clip_norm is None else grad_clip_norm

    def text_step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        lr = set_lr(optimizer, lr_at(schedule, peak_lr, state.step) * batches[0].lr_scale)
        model.train()
        device = params[0].device
        total = torch.zeros((), device=device)  # summed on the device: no sync here
        total_z = torch.zeros((), device=device) if z_loss_weight > 0 else None
        scale = loss_scale(state.step + 1) if loss_scale is not None else 1.0
        for i, batch in enumerate(batches):
            set_gradient_sync(model, i == len(batches) - 1)
            loss, z = lm_loss_and_z(
                model, batch, autocast, stats, loss_chunk_size, with_z=total_z is not None
            )
            objective = None
            if total_z is not None and z is not None:
                total_z += z.detach()
                objective = loss + z_loss_weight * z
            if scale != 1.0:  # fault injection (tests only)
                loss = loss * scale
                objective = objective * scale if objective is not None else None
            ((objective if objective is not None else loss) / len(batches)).backward()
            total += loss.detach().float()
        grad_norm = global_grad_norm(params)
        tokens = sum(b.num_tokens for b in batches) * dp_size
        n = len(batches)
        mean_z = total_z / n if total_z is not None else None
        return finish_step(
            optimizer, params, total / n, grad_norm, max_norm, tokens=tokens, lr=lr, z_loss=mean_z
        )

    return text_step


def make_pipeline_step(
    stage: nn.Module,
    optimizer: torch.optim.Optimizer,
    pipeline: PipelineContext,
    schedule: Schedule,
    peak_lr: float,
    grad_clip_norm: float | None,
    *,
    dp_size: int = 1,
    loss_chunk_size: int = 0,
) -> Callable[[tuple[Batch, ...], LoopState], StepResult]:
    """One optimizer step through the pipeline: the step's micro-batches are concatenated and
    the schedule splits them again, one per pipeline micro-batch. The last stage computes the
    loss chunk by chunk when ``loss_chunk_size`` > 0.

    The loss (known on the last stage) reaches every rank by a sum over the pipeline group;
    the grad norm is global across stages, so every rank takes the same finite/skip branch.
    """
    params = [p for p in stage.parameters() if p.requires_grad]
    max_norm = math.inf if grad_clip_norm is None else grad_clip_norm

    def pipeline_step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        lr = set_lr(optimizer, lr_at(schedule, peak_lr, state.step) * batches[0].lr_scale)
        stage.train()
        inputs = torch.cat([b.inputs for b in batches])
        labels = torch.cat([b.labels for b in batches])
        losses: list[torch.Tensor] = []
        if pipeline.is_first:
            pipeline.schedule.step(inputs)
        elif pipeline.is_last:
            pipeline.schedule.step(
                target=labels, losses=losses, **head_kwargs(labels, loss_chunk_size)
            )
        else:
            pipeline.schedule.step()
        if losses:
            loss = torch.stack(losses).mean().detach().float()
        else:  # not the last stage: contributes 0 to the sum, on the device the group reduces on
            loss = torch.zeros((), device=params[0].device)
        torch_dist.all_reduce(loss, group=pipeline.group)
        grad_norm = global_grad_norm(params, pipeline.group)
        tokens = sum(b.num_tokens for b in batches) * dp_size
        return finish_step(optimizer, params, loss, grad_norm, max_norm, tokens=tokens, lr=lr)

    return pipeline_step


@torch.no_grad()
def evaluate_loss(
    model: nn.Module, batches: list[Batch], precision: Precision, loss_chunk_size: int = 0
) -> tuple[float, int]:
    """Summed loss over the unmasked labels of ``batches`` and their number, in eval mode
    (sums, so that ranks combine them into the mean over the union of their batches)."""
    autocast = autocast_for(precision, device_type_of(model))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, labels; read once at the end
    for batch in batches:
        summed = token_losses(model, batch, autocast, loss_chunk_size)[0].sum()
        counted = (batch.labels != IGNORE_INDEX).sum()
        sums += torch.stack([summed.double(), counted.double()])
    model.train(was_training)
    total, count = sums.tolist()
    return total, int(count)


@torch.no_grad()
def evaluate_pipeline_loss(
    stage: nn.Module,
    pipeline: PipelineContext,
    batches: list[Batch],
    n_microbatches: int,
    loss_chunk_size: int = 0,
) -> float:
    """Mean loss over ``batches`` run forward-only through the pipeline, on every stage.

    Batches are concatenated in groups of ``n_microbatches`` (the schedule's split); a partial
    group at the end is left out.
    """
    was_training = stage.training
    stage.eval()
    losses: list[torch.Tensor] = []
    for start in range(0, len(batches) - n_microbatches + 1, n_microbatches):
        group = batches[start : start + n_microbatches]
        inputs = torch.cat([b.inputs for b in group])
        labels = torch.cat([b.labels for b in group])
        if pipeline.is_first:
            pipeline.schedule.eval(inputs)
        elif pipeline.is_last:
            group_losses: list[torch.Tensor] = []  # the schedule clears the list it is given
            pipeline.schedule.eval(
                target=labels, losses=group_losses, **head_kwargs(labels, loss_chunk_size)
            )
            losses += group_losses
        else:
            pipeline.schedule.eval()
    stage.train(was_training)
    device = next(stage.parameters()).device
    loss = torch.stack(losses).mean().float() if losses else torch.zeros((), device=device)
    torch_dist.all_reduce(loss, group=pipeline.group)
    return float(loss)
