"""The language-model step and its vision-language variation."""

from __future__ import annotations

import contextlib
import functools

import attrs
import torch

from forge.data.batch import Batch
from forge.metrics.sources import SourceStats
from forge.model.precision import autocast_for, device_type_of
from forge.parallel.grad_norm import global_grad_norm
from forge.training.steps.checked import checked_step
from forge.training.steps.common import (
    StepTotals,
    label_counts,
    micro_batch_loss,
    mtp_depth_of,
    set_gradient_sync,
    step_label_weight,
    trainable_parameters,
    with_depth_counts,
)
from forge.training.steps.replay import Computation, StepComputation
from forge.training.steps.spec import StepFunction, StepSpec
from forge.types import LoopState, StepResult


def make_text_step(spec: StepSpec) -> StepFunction:
    """The language-model step: accumulate gradients, clip, and update only if all is finite.

    One host sync per step (``finish_step``); the finiteness check comes before
    ``optimizer.step()`` so a non-finite step never touches the optimizer state. The grad norm
    is global over every shard, so all ranks agree on whether the step is finite. The loss is
    this rank's; it is averaged over data-parallel ranks only when logged. With a z-loss the
    reported ``loss`` stays the cross-entropy, ``z_loss`` the mean term; a mixture's
    per-source sums and a MoE model's statistics are summed over micro-batches and reported.
    A replayed step (``spec.replay``) computes the gradients again and compares them
    (``forge.training.steps.replay``) before anything is applied.
    """
    return checked_step(spec, text_computation(spec))


def text_computation(spec: StepSpec) -> StepComputation:
    """One computation of a step's gradients (forward and backward of every micro-batch),
    which a replay repeats and the start-up's kernel probe runs once.
    Every labelled token of the step weighs the same wherever it sits (``label_weight``):
    packed rows, masked labels and captions of unequal length give a loss and gradient that
    do not depend on how the batch is split into micro-batches and data-parallel ranks.
    """
    model, loss_spec = spec.model, spec.loss
    depth = mtp_depth_of(model)
    autocast = (
        contextlib.nullcontext
        if spec.fsdp_mixed_precision
        else autocast_for(spec.precision, device_type_of(model))
    )
    replicas = spec.replicas

    def label_weights(batches: tuple[Batch, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each micro-batch's labels (and each depth's targets) and one label's weight, once
        per step: every computation of it (a replay, a high-precision check) weighs alike."""
        # each depth's targets beside the main labels: one all-reduce for all
        counts = with_depth_counts(label_counts(batches), batches, depth, model)
        across = None if replicas is None else replicas.labels
        return counts, step_label_weight(counts, spec.token_slices, spec.world_size, across)

    def gradients(
        batches: tuple[Batch, ...],
        weights: tuple[torch.Tensor, torch.Tensor],
        step: int,
        computation: int,
    ) -> StepTotals:
        params = trainable_parameters(model)  # a freeze schedule may change them
        device = next(model.parameters()).device
        total = torch.zeros((), device=device)  # summed on the device: no sync here
        total_z = torch.zeros((), device=device) if loss_spec.z_weight > 0 else None
        stats = SourceStats(spec.sources, device) if spec.sources else None
        moe: torch.Tensor | None = None
        n = len(batches)
        counts, weight = weights
        main_counts, main_weight = (counts[:, 0], weight[0]) if depth else (counts, weight)
        shares = (main_counts * main_weight).unbind()
        depth_weight = weight[1:] if depth else None  # one target of depth k, at any split
        mtp = torch.zeros(depth, device=device) if depth else None
        for i, batch in enumerate(batches):
            set_gradient_sync(model, i == n - 1)
            terms = micro_batch_loss(model, batch, autocast, stats, loss_spec)
            objective = terms.objective * shares[i]
            if terms.depths is not None and depth_weight is not None and mtp is not None:
                weighed = terms.depths * depth_weight
                objective = objective + loss_spec.mtp_weight / depth * weighed.sum()
                mtp += weighed.detach()
            objective.backward()
            total += terms.loss.float() * shares[i]
            if total_z is not None and terms.z is not None:
                total_z += terms.z * shares[i]
            if terms.moe is not None:
                moe = terms.moe if moe is None else moe + terms.moe
        if spec.fault is not None:
            total = spec.fault(step, computation, params, total)
        return StepTotals(
            loss=total,
            grad_norm=global_grad_norm(params),
            params=params,
            tokens=sum(b.num_tokens for b in batches) * spec.token_slices,
            micro_batches=n,
            z_loss=total_z,
            moe=moe,
            sources=stats.drain() if stats is not None else None,
            mtp=mtp,
        )

    def for_step(batches: tuple[Batch, ...], step: int) -> Computation:
        return functools.partial(gradients, batches, label_weights(batches), step)

    return for_step


def make_vlm_step(spec: StepSpec) -> StepFunction:
    """The vision-language step (``joint_decoder_step`` or ``cross_attention_step``, by
    ``spec.vlm``): the text step's accumulate, clip and update over micro-batches that carry
    images, which the model takes beside the caption tokens; the loss counts caption tokens
    only, each alike (captions differ in length). Reports the step's images (over the
    data-parallel ranks) for images/s."""
    if spec.vlm is None:
        raise ValueError("a vision-language step needs spec.vlm (model.vlm)")
    arch = spec.vlm
    text_step = make_text_step(spec)

    def vlm_step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        if any(b.images is None for b in batches):
            raise ValueError(f"{arch.value}: a vision-language step needs batches with images")
        result = text_step(batches, state)
        return attrs.evolve(result, images=sum(b.num_images for b in batches) * spec.token_slices)

    vlm_step.__name__ = vlm_step.__qualname__ = f"{arch.value}_step"
    return vlm_step
