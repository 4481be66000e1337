"""Step functions: one optimizer step over one step's micro-batches, behind the ``StepFn`` seam."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from forge.config.sections import ModelConfig, Precision, TrainConfig, VlmArch
from forge.data.loader import Batch
from forge.data.packing import IGNORE_INDEX
from forge.metrics.sources import SourceStats
from forge.model.chunked_loss import LossSpec
from forge.model.moe import ASSIGNED, AUX, DROPPED, LOADS, Z, moe_terms
from forge.model.transformer import is_moe, split_moe_output
from forge.optim.schedules import Schedule, lr_at
from forge.parallel.grad_norm import clip_coefficient, global_grad_norm, scale_grads_
from forge.parallel.pipeline import head_kwargs
from forge.training.context import PipelineContext
from forge.training.expert_balance import balance_experts, global_loads
from forge.training.state import (
    LoopState,
    MoeStepStats,
    PendingStep,
    StepResult,
    stats_from_flat,
)

PLAIN_LOSS = LossSpec()  # the full fp32 logits, then F.cross_entropy


def loss_spec_of(
    train: TrainConfig, compiled: bool = False, model: ModelConfig | None = None
) -> LossSpec:
    """The loss the ``[train]`` keys ask for: chunked by ``loss_chunk_size``, with the
    z-loss weight, each chunk compiled when the model is (``ModelContext.compiled``); with a
    mixture-of-experts ``model``, its auxiliary-loss weights."""
    aux = z = 0.0
    if model is not None and model.moe:
        aux, z = model.moe_aux_loss_weight, model.moe_z_loss_weight
    return LossSpec(train.loss_chunk_size, train.z_loss_weight, compiled, aux, z)


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
    return logits_and_stats(model, batch, autocast)[0]


def logits_and_stats(
    model: nn.Module, batch: Batch, autocast: Callable
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 logits and, for a mixture-of-experts model, its MoE statistics."""
    with autocast():
        output = model(batch.inputs, **input_kwargs(batch))
    logits, stats = split_moe_output(output, is_moe(model))
    return logits.float(), stats


def input_kwargs(batch: Batch) -> dict[str, torch.Tensor | None]:
    """The model's keyword inputs beside the tokens: per-token positions and documents of
    packed rows, the images of image–caption rows."""
    kwargs: dict[str, torch.Tensor | None] = {}
    if batch.document_ids is not None:
        kwargs |= {"positions": batch.positions, "document_ids": batch.document_ids}
    if batch.images is not None:
        kwargs["images"] = batch.images
    return kwargs


@attrs.frozen
class MicroBatchLoss:
    """One micro-batch's loss: ``objective`` to differentiate, ``loss`` (the mean
    cross-entropy) and ``z`` (the mean squared logsumexp, None when the z-loss is off) to log,
    and a mixture-of-experts model's statistics (``forge.model.moe``; None when dense)."""

    objective: torch.Tensor
    loss: torch.Tensor
    z: torch.Tensor | None
    moe: torch.Tensor | None = None


def micro_batch_loss(
    model: nn.Module,
    batch: Batch,
    autocast: Callable,
    stats: SourceStats | None = None,
    loss_spec: LossSpec = PLAIN_LOSS,
) -> MicroBatchLoss:
    """Next-token cross-entropy in fp32 over the unmasked labels, plus ``loss_spec.z_weight``
    × ``mean(logsumexp(logits)²)`` in the objective.

    A chunked ``loss_spec``: the model computes it chunk by chunk (``chunked_lm_loss``) and the
    full logits never exist; else the plain path, fp32 logits then ``F.cross_entropy``. With
    ``stats``, also adds each row's loss sum and label count to its source's totals. A
    mixture-of-experts model's auxiliary losses join the objective (``moe_terms``).
    """
    counted = batch.labels != IGNORE_INDEX
    n = counted.sum()
    z_weight = loss_spec.z_weight
    if loss_spec.chunked:
        with autocast():
            output = model(batch.inputs, labels=batch.labels, loss=loss_spec, **input_kwargs(batch))
        (objective, per_token, z), moe = split_moe_output(output, is_moe(model))
    else:
        logits, moe = logits_and_stats(model, batch, autocast)
        per_token = F.cross_entropy(logits.transpose(1, 2), batch.labels, reduction="none")
        objective = per_token.sum() / n
        z = None
        if z_weight > 0:
            z = (logits.logsumexp(-1).square() * counted).sum() / n
            objective = objective + z_weight * z
    if stats is not None and batch.sources is not None:
        stats.add(batch.sources, per_token.detach().sum(dim=1), counted.sum(dim=1))
    if moe is not None:
        objective = objective + moe_terms(moe, loss_spec.moe_aux_weight, loss_spec.moe_z_weight)[0]
        moe = moe.detach()
    loss = per_token.detach().sum() / n
    z_logged = z.detach() if z is not None and z_weight > 0 else None
    return MicroBatchLoss(objective, loss, z_logged, moe)


def moe_summary(stats: torch.Tensor, n_micro: int) -> torch.Tensor:
    """A step's MoE statistics (summed over its ``n_micro`` micro-batches) as one flat
    tensor for the host read: mean aux and z losses per layer and micro-batch, dropped and
    assigned counts, then every layer's loads."""
    means = stats[:, [AUX, Z]].mean(0) / n_micro
    counts = stats[:, [DROPPED, ASSIGNED]].sum(0)
    return torch.cat([means, counts, stats[:, LOADS:].flatten()])


def moe_step_stats(values: Sequence[float], n_layers: int) -> MoeStepStats:
    """``moe_summary``'s values, read on the host."""
    n_experts = (len(values) - 4) // n_layers
    return stats_from_flat(values, n_layers, n_experts)


def balance_after_update(
    model: nn.Module, stats: torch.Tensor | None, rate: float, world_size: int
) -> Callable[[], None] | None:
    """The aux-loss-free bias update this step applies after ``optimizer.step()`` (None when
    off): the step's loads, summed over ranks here, so every rank applies the same update."""
    if stats is None or rate <= 0:
        return None
    loads = global_loads(stats[:, LOADS:], world_size)
    return lambda: balance_experts(model, loads, rate)


def label_shares(batches: Sequence[Batch], dp_size: int) -> list[torch.Tensor]:
    """Each micro-batch's weight when every labelled token of the step counts the same, on
    this rank and every other data-parallel one: its labels over the step's labels on all
    ``dp_size`` ranks (one all-reduce), times ``dp_size`` (the gradient reduction averages
    over ranks). Rows of unequal length (captions, packed documents) need it for a gradient
    that does not depend on how the batch is split. The sum runs over the default group:
    only for steps whose ranks are all data-parallel (the vision-language step)."""
    counts = torch.stack([(b.labels != IGNORE_INDEX).sum() for b in batches]).float()
    total = counts.sum()
    if dp_size > 1:
        torch_dist.all_reduce(total)
    shares = counts * dp_size / total
    return list(shares.unbind())


def trainable_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that get gradients this step."""
    return [p for p in model.parameters() if p.requires_grad]


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
    step: int = 0,
    before_update: Callable[[PendingStep], None] | None = None,
    moe: torch.Tensor | None = None,
    micro_batches: int = 1,
    after_update: Callable[[], None] | None = None,
) -> StepResult:
    """Clip by the global norm and step, only if loss, norm (and z-loss, and a MoE model's
    auxiliary losses) are finite; report the step.

    Reads them in one host sync (one device-to-host copy of all; ``moe`` is a MoE model's
    statistics summed over the step's ``micro_batches``, read as ``moe_summary``).
    ``before_update`` sees step ``step`` after that read, before clipping; ``after_update``
    runs right after an applied ``optimizer.step()`` (the experts' balancing bias). A
    non-finite step zeroes the gradients and never touches the optimizer state.
    """
    read = [loss.float(), grad_norm.float(), *([z_loss.float()] if z_loss is not None else [])]
    summary = [moe_summary(moe, micro_batches)] if moe is not None else []
    values = torch.cat([torch.stack(read), *summary]).tolist()
    result = StepResult(
        loss=values[0],
        grad_norm=values[1],
        tokens=tokens,
        lr=lr,
        z_loss=values[2] if z_loss is not None else None,
        moe=moe_step_stats(values[len(read) :], moe.shape[0]) if moe is not None else None,
    )
    if before_update is not None:
        before_update(PendingStep(step, result))
    if result.finite:
        if math.isfinite(max_norm):
            scale_grads_(params, clip_coefficient(result.grad_norm, max_norm))
        optimizer.step()
        if after_update is not None:
            after_update()
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
    loss_spec: LossSpec = PLAIN_LOSS,
    before_update: Callable[[PendingStep], None] | None = None,
    balance_rate: float = 0.0,
    world_size: int = 1,
    token_weighted: bool = False,
) -> Callable[[tuple[Batch, ...], LoopState], StepResult]:
    """The language-model step: accumulate gradients, clip, and update only if all is finite.

    One host sync per step (loss and grad norm together); the finiteness check comes before
    ``optimizer.step()`` so a non-finite step never touches the optimizer state. The grad norm
    is global over every shard, so all ranks agree on whether the step is finite. The loss is
    this rank's; it is averaged over data-parallel ranks only when logged. ``loss_scale``
    (tests only) multiplies the loss of a given step, e.g. by NaN. ``stats`` collects
    per-source losses of a mixture. ``loss_spec`` says how the loss is computed
    (``micro_batch_loss``); with a z-loss weight the reported ``loss`` stays the
    cross-entropy, ``z_loss`` the mean term. ``before_update`` sees each step before its
    gradients are clipped and applied. A mixture-of-experts model's statistics are summed
    over micro-batches and reported; with ``balance_rate`` its routers' biases move after the
    update (``balance_experts``, loads summed over ``world_size`` ranks). With
    ``token_weighted`` every labelled token of the step weighs the same wherever it sits
    (``label_shares``); else each micro-batch's mean counts ``1 / micro-batches``.
    """
    autocast = (
        contextlib.nullcontext
        if fsdp_mixed_precision
        else autocast_for(precision, device_type_of(model))
    )
    max_norm = math.inf if grad_clip_norm is None else grad_clip_norm

    def text_step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        lr = set_lr(optimizer, lr_at(schedule, peak_lr, state.step) * batches[0].lr_scale)
        model.train()
        params = trainable_parameters(model)  # a freeze schedule may change them
        device = next(model.parameters()).device
        total = torch.zeros((), device=device)  # summed on the device: no sync here
        total_z = torch.zeros((), device=device) if loss_spec.z_weight > 0 else None
        scale = loss_scale(state.step + 1) if loss_scale is not None else 1.0
        moe: torch.Tensor | None = None
        n = len(batches)
        shares = label_shares(batches, dp_size) if token_weighted else [1.0 / n] * n
        for i, batch in enumerate(batches):
            set_gradient_sync(model, i == n - 1)
            terms = micro_batch_loss(model, batch, autocast, stats, loss_spec)
            objective = terms.objective
            if scale != 1.0:  # fault injection (tests only)
                objective = objective * scale
            (objective * shares[i]).backward()
            total += terms.loss.float() * shares[i] * scale
            if total_z is not None and terms.z is not None:
                total_z += terms.z * shares[i]
            if terms.moe is not None:
                moe = terms.moe if moe is None else moe + terms.moe
        grad_norm = global_grad_norm(params)
        tokens = sum(b.num_tokens for b in batches) * dp_size
        return finish_step(
            optimizer,
            params,
            total,
            grad_norm,
            max_norm,
            tokens=tokens,
            lr=lr,
            z_loss=total_z,
            step=state.step + 1,
            before_update=before_update,
            moe=moe,
            micro_batches=n,
            after_update=balance_after_update(model, moe, balance_rate, world_size),
        )

    return text_step


def make_vlm_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    peak_lr: float,
    precision: Precision,
    grad_clip_norm: float | None,
    *,
    arch: VlmArch,
    dp_size: int = 1,
    **text_options: Any,
) -> Callable[[tuple[Batch, ...], LoopState], StepResult]:
    """The vision-language step (``joint_decoder_step`` or ``cross_attention_step``, by
    ``arch``): the text step's accumulate, clip and update over micro-batches that carry
    images, which the model takes beside the caption tokens; the loss counts caption tokens
    only. Reports the step's images (over ``dp_size`` ranks) for images/s.
    ``text_options``: ``make_text_step``'s keywords."""
    text_step = make_text_step(
        model,
        optimizer,
        schedule,
        peak_lr,
        precision,
        grad_clip_norm,
        dp_size=dp_size,
        token_weighted=True,  # captions differ in length: every caption token counts alike
        **text_options,
    )

    def vlm_step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        if any(b.images is None for b in batches):
            raise ValueError(f"{arch.value}: a vision-language step needs batches with images")
        result = text_step(batches, state)
        return attrs.evolve(result, images=sum(b.num_images for b in batches) * dp_size)

    vlm_step.__name__ = vlm_step.__qualname__ = f"{arch.value}_step"
    return vlm_step


def make_pipeline_step(
    stage: nn.Module,
    optimizer: torch.optim.Optimizer,
    pipeline: PipelineContext,
    schedule: Schedule,
    peak_lr: float,
    grad_clip_norm: float | None,
    *,
    dp_size: int = 1,
    loss_spec: LossSpec = PLAIN_LOSS,
    before_update: Callable[[PendingStep], None] | None = None,
    moe_shape: tuple[int, int] | None = None,
    balance_rate: float = 0.0,
    world_size: int = 1,
) -> Callable[[tuple[Batch, ...], LoopState], StepResult]:
    """One optimizer step through the pipeline: the step's micro-batches are concatenated and
    the schedule splits them again, one per pipeline micro-batch. The last stage computes the
    loss chunk by chunk when ``loss_spec`` is chunked.

    The loss (known on the last stage) reaches every rank by a sum over the pipeline group;
    the grad norm is global across stages, so every rank takes the same finite/skip branch.
    A mixture-of-experts model's statistics (``moe_shape``: MoE layers × columns) travel
    through the stages with the hidden states and reach every stage the same way.
    """
    max_norm = math.inf if grad_clip_norm is None else grad_clip_norm

    def pipeline_step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        lr = set_lr(optimizer, lr_at(schedule, peak_lr, state.step) * batches[0].lr_scale)
        stage.train()
        params = trainable_parameters(stage)  # a freeze schedule may change them
        inputs = torch.cat([b.inputs for b in batches])
        labels = torch.cat([b.labels for b in batches])
        if pipeline.is_first:
            pipeline.schedule.step(inputs)
        elif pipeline.is_last:
            pipeline.schedule.step(
                target=labels,
                losses=[],
                return_outputs=False,  # only the losses are needed
                **head_kwargs(labels, loss_spec),
            )
        else:
            pipeline.schedule.step()
        n = len(batches)
        loss, moe = stage_totals(pipeline, n, next(stage.parameters()).device, moe_shape)
        grad_norm = global_grad_norm(params, pipeline.group)
        tokens = sum(b.num_tokens for b in batches) * dp_size
        return finish_step(
            optimizer,
            params,
            loss,
            grad_norm,
            max_norm,
            tokens=tokens,
            lr=lr,
            step=state.step + 1,
            before_update=before_update,
            moe=moe,
            micro_batches=n,
            after_update=balance_after_update(stage, moe, balance_rate, world_size),
        )

    return pipeline_step


def stage_totals(
    pipeline: PipelineContext,
    n_micro: int,
    device: torch.device,
    moe_shape: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mean cross-entropy over the step's ``n_micro`` micro-batches and the MoE
    statistics summed over them, on every stage: the last stage has them, the others add
    zeros to the sum over the pipeline group."""
    records = pipeline.loss.take(n_micro)
    loss = torch.zeros((), device=device)
    if records:
        loss = torch.stack([ce for ce, _ in records]).mean().float()
    moe = torch.zeros(moe_shape or (0, 0), device=device)
    for _, stats in records:
        moe = moe + stats if stats is not None else moe
    totals = torch.cat([loss.reshape(1), moe.flatten()])  # one all-reduce for both
    torch_dist.all_reduce(totals, group=pipeline.group)
    loss = totals[0]
    if moe_shape is None:
        return loss, None
    moe = totals[1:].view(moe_shape)
    return loss, moe


@attrs.frozen
class EvalTotals:
    """Held-out sums over some batches: the summed loss over the unmasked labels, their
    number, and a mixture-of-experts model's tokens per expert ``(MoE layers, E)``."""

    loss_sum: float
    count: int
    moe_loads: list[list[float]] | None = None


@torch.no_grad()
def evaluate_totals(
    model: nn.Module, batches: list[Batch], precision: Precision, loss_spec: LossSpec = PLAIN_LOSS
) -> EvalTotals:
    """``EvalTotals`` over ``batches`` in eval mode (sums, so that ranks combine them into
    the mean over the union of their batches)."""
    autocast = autocast_for(precision, device_type_of(model))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, labels; read once at the end
    loads: torch.Tensor | None = None
    for batch in batches:
        terms = micro_batch_loss(model, batch, autocast, loss_spec=loss_spec)
        counted = (batch.labels != IGNORE_INDEX).sum()
        summed = terms.loss * counted
        sums += torch.stack([summed.double(), counted.double()])
        if terms.moe is not None:
            batch_loads = terms.moe[:, LOADS:]
            loads = batch_loads if loads is None else loads + batch_loads
    model.train(was_training)
    total, count = sums.tolist()
    return EvalTotals(total, int(count), loads.tolist() if loads is not None else None)


def evaluate_loss(
    model: nn.Module, batches: list[Batch], precision: Precision, loss_spec: LossSpec = PLAIN_LOSS
) -> tuple[float, int]:
    """Summed loss over the unmasked labels of ``batches`` and their number, in eval mode
    (``evaluate_totals`` without the expert loads)."""
    totals = evaluate_totals(model, batches, precision, loss_spec)
    return totals.loss_sum, totals.count


@torch.no_grad()
def evaluate_pipeline_loss(
    stage: nn.Module,
    pipeline: PipelineContext,
    batches: list[Batch],
    n_microbatches: int,
    loss_spec: LossSpec = PLAIN_LOSS,
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
            pipeline.schedule.eval(
                target=labels,
                losses=[],
                return_outputs=False,
                **head_kwargs(labels, loss_spec),
            )
            losses += [ce for ce, _ in pipeline.loss.take(n_microbatches)]
        else:
            pipeline.schedule.eval()
    stage.train(was_training)
    device = next(stage.parameters()).device
    loss = torch.stack(losses).mean().float() if losses else torch.zeros((), device=device)
    torch_dist.all_reduce(loss, group=pipeline.group)
    return float(loss)
