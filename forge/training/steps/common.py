"""What every step shares: the micro-batch loss, label shares, LR setting, the MoE
bookkeeping and ``finish_step`` (one host read, clip, update only if finite)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from forge.data.batch import Batch
from forge.data.packing import IGNORE_INDEX
from forge.metrics.sources import SourceStats
from forge.model.chunked_loss import PLAIN_LOSS, LossSpec
from forge.model.moe import ASSIGNED, AUX, DROPPED, LOADS, Z, moe_terms
from forge.model.mtp import depth_counts, has_mtp, split_mtp_output
from forge.model.transformer import is_moe, split_moe_output
from forge.optim.schedules import lr_at
from forge.parallel.grad_norm import clip_coefficient, global_grad_norm, scale_grads_
from forge.training.loop.expert_balance import balance_experts, global_loads
from forge.training.loop.plan import is_spike
from forge.training.steps.spec import ReplicaSums, StepSpec
from forge.types import (
    Float8Verdict,
    LoopState,
    LossStats,
    MoeStepStats,
    PendingStep,
    ReplayVerdict,
    SourceTotals,
    StepResult,
    stats_from_flat,
)


def logits_and_stats(
    model: nn.Module, batch: Batch, autocast: Callable
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 logits and, for a mixture-of-experts model, its MoE statistics."""
    with autocast():
        output = model(batch.inputs, **input_kwargs(batch))
    logits, stats = split_moe_output(output, is_moe(model))
    return logits.float(), stats


def input_kwargs(batch: Batch) -> dict[str, torch.Tensor | None]:
    """The model's keyword inputs beside the tokens: per-token positions (packed rows, and
    a context-parallel rank's part of a row) and documents of packed rows, the images of
    image–caption rows."""
    kwargs: dict[str, torch.Tensor | None] = {}
    if batch.positions is not None:
        kwargs["positions"] = batch.positions
    if batch.document_ids is not None:
        kwargs["document_ids"] = batch.document_ids
    if batch.images is not None:
        kwargs["images"] = batch.images
    return kwargs


@attrs.frozen
class MicroBatchLoss:
    """One micro-batch's loss: ``objective`` to differentiate, ``loss`` (the mean
    cross-entropy) and ``z`` (the mean squared logsumexp, None when the z-loss is off) to log,
    a mixture-of-experts model's statistics (``forge.model.moe``; None when dense), and a
    model with multi-token depths their summed cross-entropies ``(mtp_depth,)``, still to be
    weighed into the objective by the step (``forge.model.mtp``; None without)."""

    objective: torch.Tensor
    loss: torch.Tensor
    z: torch.Tensor | None
    moe: torch.Tensor | None = None
    depths: torch.Tensor | None = None


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
    n = counted.sum().clamp(min=1)  # a fully masked micro-batch adds nothing (its share is 0)
    z_weight = loss_spec.z_weight
    mtp = has_mtp(model) and model.training  # evaluation reads the main loss only
    depths = None
    if loss_spec.chunked:
        with autocast():
            output = model(batch.inputs, labels=batch.labels, loss=loss_spec, **input_kwargs(batch))
        output, moe = split_moe_output(output, is_moe(model))
        (objective, per_token, z), depths = split_mtp_output(output, mtp)
    else:
        if mtp:  # the depths need the labels; the main head still returns the logits
            with autocast():
                output = model(
                    batch.inputs, labels=batch.labels, loss=loss_spec, **input_kwargs(batch)
                )
            output, moe = split_moe_output(output, is_moe(model))
            main, depths = split_mtp_output(output, mtp)
            logits = main.float()
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
    return MicroBatchLoss(objective, loss, z_logged, moe, depths)


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


def label_counts(batches: Sequence[Batch]) -> torch.Tensor:
    """The labelled tokens of each micro-batch, as floats on the batches' device."""
    return torch.stack([(b.labels != IGNORE_INDEX).sum() for b in batches]).float()


def with_depth_counts(
    counts: torch.Tensor, batches: Sequence[Batch], depth: int, model: nn.Module
) -> torch.Tensor:
    """``counts`` (each micro-batch's labels) beside each micro-batch's targets of every one
    of ``depth`` multi-token depths ``(micro-batches, 1 + depth)``, at this rank's positions
    (under context parallelism counted on whole rows: ``forge.model.mtp.depth_inputs``); the
    labels alone without depths. ``model``: a model, or a pipeline rank's stages (their
    context-parallel group)."""
    if not depth:
        return counts
    parts = getattr(model, "stages", (model,))
    group = next((g for m in parts if (g := getattr(m, "context_group", None)) is not None), None)
    depths = torch.stack([depth_counts(b.labels, depth, group) for b in batches])
    return torch.cat([counts[:, None], depths], dim=1)


def mtp_depth_of(model: nn.Module) -> int:
    """The multi-token depths of ``model`` (0: none)."""
    return model.cfg.mtp_depth if has_mtp(model) else 0  # type: ignore[union-attr]


def step_labels(counts: torch.Tensor, token_slices: int, world_size: int) -> torch.Tensor:
    """The step's labelled tokens on every rank holding distinct tokens (``token_slices``:
    data-parallel × context-parallel): one all-reduce of one number over the default group
    when there are several, which counts each slice once per rank that holds it
    (``world_size / token_slices``: tensor-parallel and pipeline peers). It stays on the
    device (no host sync)."""
    total = counts.sum(0)  # per column: the main labels, and each multi-token depth's
    if token_slices > 1:
        torch_dist.all_reduce(total)
        total = total / (world_size // token_slices)
    return total


def label_weight(total: torch.Tensor, token_slices: int) -> torch.Tensor:
    """One label's weight when every labelled token of the step counts the same, on this
    rank and every other: ``token_slices`` (the gradient reduction averages over them) over
    the step's ``total`` labels, so the step's loss and gradient do not depend on how its
    rows are split into micro-batches and ranks. No labels anywhere: any finite weight (none
    is used)."""
    return token_slices / total.clamp(min=1)


def step_label_weight(
    counts: torch.Tensor,
    token_slices: int,
    world_size: int,
    across_groups: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One label's weight for a step whose micro-batches hold ``counts`` labels here: over
    every rank's labels (``step_labels``) and, under replica groups, every participating
    group's (``across_groups``: their labels summed), so that every labelled token of the
    step weighs the same wherever it sits."""
    labels = step_labels(counts, token_slices, world_size)
    if across_groups is not None:
        labels = across_groups(labels)
    return label_weight(labels, token_slices)


def trainable_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that get gradients this step."""
    return [p for p in model.parameters() if p.requires_grad]


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2: reduce-scatter gradients only on the last micro-batch of a step."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def step_lr(spec: StepSpec, state: LoopState, batches: Sequence[Batch]) -> float:
    """The learning rate of the step after ``state``: the schedule's, times the data
    phase's ``lr_scale``."""
    return lr_at(spec.schedule, spec.peak_lr, state.step) * batches[0].lr_scale


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Set every param group's learning rate; returns it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


@attrs.frozen
class StepTotals:
    """What a step measured, still on the device: the mean loss over its micro-batches, the
    global grad norm of ``params`` (the parameters it trained, clipped by ``finish_step``),
    the mean z-loss (None when off), a MoE model's statistics summed over the
    ``micro_batches`` (None when dense) and a mixture's per-source sums ``(2, sources)``
    (None without); ``tokens`` over every data-parallel rank."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    params: Sequence[torch.Tensor]
    tokens: int
    micro_batches: int = 1
    z_loss: torch.Tensor | None = None
    moe: torch.Tensor | None = None
    sources: torch.Tensor | None = None
    mtp: torch.Tensor | None = None  # each multi-token depth's mean loss (None without)


def fails_alone(replay: ReplayVerdict | None, float8: Float8Verdict | None) -> bool:
    """Whether this group's own checks refuse its step (a replay without a majority, an FP8
    drift that stops the run): under replica groups no group may apply a sum it is in."""
    return bool((replay is not None and replay.failed) or (float8 is not None and float8.stops))


def over_groups(
    totals: StepTotals,
    replicas: ReplicaSums,
    vetoed: bool,
    norm_of: Callable[[Sequence[torch.Tensor]], torch.Tensor] = global_grad_norm,
) -> StepTotals:
    """``totals`` of this replica group's share summed with every group's taking part in
    the step (``[fault_tolerance]``): gradients, loss and every additive total, the grad
    norm of the summed gradients (``norm_of`` the parameters: a pipeline's spans its
    stages), the whole step's tokens and micro-batches. ``vetoed``: this group's checks
    refuse the step; the step then commits in no group."""
    tensors = (totals.loss, totals.z_loss, totals.moe, totals.sources, totals.mtp)
    replicas.totals(totals.params, vetoed, *tensors)
    per_micro = totals.tokens // max(1, totals.micro_batches)
    return attrs.evolve(
        totals,
        grad_norm=norm_of(totals.params),
        tokens=per_micro * replicas.slots,
        micro_batches=replicas.slots,
    )


def finish_step(
    spec: StepSpec,
    totals: StepTotals,
    step: int,
    lr: float,
    stats: LossStats | None = None,
    replay: ReplayVerdict | None = None,
    float8: Float8Verdict | None = None,
) -> StepResult:
    """Clip by the global norm and step, only if loss, norm (and z-loss, and a MoE model's
    auxiliary losses) are finite, the loss is not a spike that ``spec`` drops (measured
    against ``stats``, the loop's running statistics), a replayed step found a majority and
    an FP8 step checked against high precision does not stop the run (``float8``);
    report step ``step`` (1-based), read by ``read_result``.

    ``spec.before_update`` sees the step after that read, before clipping; a MoE model's
    balancing bias moves right after an applied ``optimizer.step()``. A step not applied
    zeroes the gradients and never touches the optimizer state.
    """
    after_update = balance_after_update(spec.model, totals.moe, spec.bias_rate, spec.world_size)
    world = world_mean(totals.loss, spec.world_size) if spec.spike_threshold > 0 else None
    result = read_result(totals, lr, world)
    spike = result.world_loss is not None and is_spike(
        result.world_loss, stats or LossStats(), spec.spike_threshold
    )
    result = attrs.evolve(result, spike=spike, replay=replay, float8=float8)
    if spec.before_update is not None:
        spec.before_update(PendingStep(step, result))
    failed = (replay is not None and replay.failed) or (float8 is not None and float8.stops)
    # replica groups: a step every group of the quorum finished, asked of all of them alike
    committed = spec.replicas.commit() if spec.replicas is not None else True
    applied = result.finite and not (spike and spec.drops_spike) and not failed and committed
    result = attrs.evolve(result, applied=applied)
    if applied:
        if math.isfinite(spec.max_norm):
            coefficient = clip_coefficient(result.grad_norm, spec.max_norm)
            scale_grads_(totals.params, coefficient)
        spec.optimizer.step()
        if after_update is not None:
            after_update()
    spec.optimizer.zero_grad(set_to_none=True)
    return result


def world_mean(loss: torch.Tensor, world_size: int) -> torch.Tensor:
    """The step's loss over every rank, on the device (one all-reduce of one number when
    there are several): each rank's loss is its tokens' share of the step's mean, and ranks
    that share tokens (tensor-parallel, pipeline peers) hold the same share, so the mean over
    ranks is the step's mean."""
    total = loss.detach().clone()
    if world_size > 1:
        torch_dist.all_reduce(total)
        total = total / world_size
    return total


def read_result(
    totals: StepTotals, lr: float, world_loss: torch.Tensor | None = None
) -> StepResult:
    """The step's ``StepResult``, every total read in one host sync (one device-to-host
    copy; a MoE model's statistics as ``moe_summary``), with ``world_loss`` when given."""
    scalars = [totals.loss, totals.grad_norm]
    if totals.z_loss is not None:
        scalars.append(totals.z_loss)
    if world_loss is not None:
        scalars.append(world_loss)
    moe = moe_summary(totals.moe, totals.micro_batches) if totals.moe is not None else None
    sources = totals.sources.flatten() if totals.sources is not None else None
    parts = [
        torch.stack([t.float() for t in scalars]),
        *(t for t in (moe, sources) if t is not None),
    ]
    if totals.mtp is not None:  # last: the others are read by position from the front
        parts.append(totals.mtp.float())
    values = torch.cat([t.double() for t in parts]).tolist()  # fp32 -> fp64: exact
    mtp = None
    if totals.mtp is not None:
        depth = totals.mtp.numel()
        values, mtp = values[:-depth], tuple(values[-depth:])
    head, n_moe = len(scalars), moe.numel() if moe is not None else 0
    return StepResult(
        loss=values[0],
        grad_norm=values[1],
        tokens=totals.tokens,
        lr=lr,
        z_loss=values[2] if totals.z_loss is not None else None,
        world_loss=values[head - 1] if world_loss is not None else None,
        moe=moe_step_stats(values[head : head + n_moe], totals.moe.shape[0])
        if totals.moe is not None
        else None,
        sources=SourceTotals.from_flat(values[head + n_moe :]) if sources is not None else None,
        mtp=mtp,
    )
