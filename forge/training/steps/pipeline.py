"""The pipeline step, and the one place that drives this rank's stages through a schedule
(training and evaluation alike)."""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as torch_dist

from forge.data.batch import Batch
from forge.metrics.sources import SourceStats
from forge.model.chunked_loss import LossSpec
from forge.parallel.grad_norm import global_grad_norm
from forge.parallel.pipeline import head_kwargs
from forge.parallel.pipeline_loss import source_sums, stage_sums, with_sources
from forge.training.context import PipelineContext
from forge.training.steps.checked import checked_step
from forge.training.steps.common import (
    StepTotals,
    label_counts,
    step_label_weight,
    trainable_parameters,
    with_depth_counts,
)
from forge.training.steps.replay import Computation, StepComputation
from forge.training.steps.spec import StepFunction, StepSpec


class Pass(enum.Enum):
    """What a schedule run does: forward and backward (``step``), or forward only (``eval``)."""

    TRAIN = "train"
    EVAL = "eval"


def stage_inputs(
    pipeline: PipelineContext, batches: Sequence[Batch], loss: LossSpec
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """The schedule's positional and keyword inputs on this rank, each the concatenation of
    ``batches`` (the schedule splits them again, one per micro-batch): the first stage feeds
    the tokens, the last the labels (and, with a chunked ``loss``, computes it itself; with
    multi-token depths, it takes the tokens too and computes their losses). Packed
    rows' positions and document ids go to every stage as keyword inputs, split alike: each
    stage's attention and RoPE need them (they are not activations to send on)."""
    args = (torch.cat([b.inputs for b in batches]),) if pipeline.is_first else ()
    kwargs: dict[str, Any] = {}
    for key in ("positions", "document_ids"):
        parts = [getattr(b, key) for b in batches]
        if all(part is not None for part in parts):
            kwargs[key] = torch.cat(parts)
    if pipeline.is_last:
        labels = torch.cat([b.labels for b in batches])
        target = labels
        if pipeline.loss.sources:
            target = with_sources(labels, torch.cat([sources_of(b) for b in batches]))
        kwargs |= {"target": target, "losses": [], "return_outputs": False}
        tokens = torch.cat([b.inputs for b in batches]) if pipeline.loss.depth else None
        kwargs |= head_kwargs(labels, loss, tokens)
    return args, kwargs


def sources_of(batch: Batch) -> torch.Tensor:
    """Each row's source index (a mixture's batches carry them)."""
    if batch.sources is None:
        raise ValueError("a mixture's per-source losses need batches that carry sources")
    return batch.sources


def run_stage(
    pipeline: PipelineContext, batches: Sequence[Batch], loss: LossSpec, mode: Pass
) -> None:
    """Run ``batches`` through this rank's stages (``stage_inputs``), with backward
    (``Pass.TRAIN``: the schedule's ``n_microbatches`` at a time, gradients summed — a
    replica group's share of a step may be several) or forward only (``Pass.EVAL``)."""
    if mode is Pass.TRAIN:
        n = pipeline.n_microbatches
        if len(batches) % n:
            raise ValueError(
                f"{len(batches)} micro-batches do not run through a schedule of {n} at a time"
            )
        for start in range(0, len(batches), n):
            args, kwargs = stage_inputs(pipeline, batches[start : start + n], loss)
            pipeline.schedule.step(*args, **kwargs)
        return
    args, kwargs = stage_inputs(pipeline, batches, loss)
    from forge.parallel.schedules import forward_only  # a pipeline's: see pipeline_of

    with forward_only(pipeline.schedule):
        pipeline.schedule.eval(*args, **kwargs)


def make_pipeline_step(spec: StepSpec, pipeline: PipelineContext) -> StepFunction:
    """One optimizer step through the pipeline (``run_stage``).

    Every label of the step weighs the same across micro-batches and data-parallel ranks
    (``StageLoss.weigh``), as in ``text_step``. The loss, z term and a mixture of experts'
    statistics (known on the last stage; the statistics travel through the stages with the
    hidden states) reach every rank by a sum over the pipeline group. An embedding tied
    across pipeline ranks sums its two gradients first. The grad norm is global across
    stages (the tied weight counted once), so every rank takes the same finite/skip branch.
    """
    computation = pipeline_computation(spec, pipeline)
    return checked_step(spec, computation, functools.partial(stage_norm, pipeline))


def stage_norm(pipeline: PipelineContext, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The grad norm across stages, an embedding tied across pipeline ranks counted once."""
    tied = pipeline.tied
    counted = [p for p in params if tied is None or tied.in_norm or p is not tied.weight]
    return global_grad_norm(counted, pipeline.group)


def pipeline_computation(spec: StepSpec, pipeline: PipelineContext) -> StepComputation:
    """One computation of a step's gradients through the pipeline (``run_stage``), which a
    replay repeats and the start-up's kernel probe runs once."""
    stage = spec.model
    with_z = spec.loss.z_weight > 0
    replicas = spec.replicas

    def label_weights(batches: tuple[Batch, ...]) -> torch.Tensor:
        """One label's weight (and each depth's target's), once per step: every computation
        of it (a replay, a high-precision check) weighs alike."""
        # the model's depths on every pipeline rank (one all-reduce of one shape)
        counts = with_depth_counts(label_counts(batches), batches, pipeline.loss.depth, stage)
        across = None if replicas is None else replicas.labels
        return step_label_weight(counts, spec.token_slices, spec.world_size, across)

    def gradients(
        batches: tuple[Batch, ...], weight: torch.Tensor, step: int, computation: int
    ) -> StepTotals:
        params = trainable_parameters(stage)  # a freeze schedule may change them
        device = next(stage.parameters()).device
        if pipeline.loss.depth:  # one target of depth k weighs the same at any split
            pipeline.loss.weigh(weight[0], weight[1:])
        else:
            pipeline.loss.weigh(weight)
        pipeline.loss.track(bool(spec.sources))
        try:
            run_stage(pipeline, batches, spec.loss, Pass.TRAIN)
        finally:
            pipeline.loss.track(False)  # evaluation runs untracked
        if pipeline.tied is not None:
            pipeline.tied.sum_grads()
        n = len(batches)
        measured = stage_totals(pipeline, n, device, spec.moe_shape, with_z, spec.sources)
        loss = measured.loss
        if spec.fault is not None:
            loss = spec.fault(step, computation, params, loss)
        return StepTotals(
            loss=loss,
            grad_norm=stage_norm(pipeline, params),
            params=params,
            tokens=sum(b.num_tokens for b in batches) * spec.token_slices,
            micro_batches=n,
            z_loss=measured.z,
            moe=measured.moe,
            sources=measured.sources,
            mtp=measured.mtp,
        )

    def for_step(batches: tuple[Batch, ...], step: int) -> Computation:
        return functools.partial(gradients, batches, label_weights(batches), step)

    return for_step


@attrs.frozen
class StageTotals:
    """What the last stage measured of a step, on every stage: the token-weighted loss, its
    z term (None when off), the MoE statistics (None when dense), a mixture's per-source
    sums ``(2, sources)`` (None without) and the multi-token depths' weighed losses
    ``(depth,)`` (None without)."""

    loss: torch.Tensor
    z: torch.Tensor | None = None
    moe: torch.Tensor | None = None
    sources: torch.Tensor | None = None
    mtp: torch.Tensor | None = None


def stage_totals(
    pipeline: PipelineContext,
    n_micro: int,
    device: torch.device,
    moe_shape: tuple[int, int] | None,
    with_z: bool = False,
    sources: tuple[str, ...] = (),
) -> StageTotals:
    """The step's ``StageTotals`` over its ``n_micro`` micro-batches, on every stage: the last
    stage has them, the others add zeros to the sum over the pipeline group (one
    all-reduce, in fp64: each value has one non-zero term, so the sum is exact)."""
    records = pipeline.loss.take(n_micro)
    loss, z = stage_sums(records, device, with_z)
    moe = torch.zeros(moe_shape or (0, 0), device=device)
    for r in records:
        moe = moe + r.moe if r.moe is not None else moe
    per_source = torch.zeros((2, len(sources)), dtype=torch.float64, device=device)
    if sources and records:
        per_source = source_sums(records, SourceStats(sources, device))
    depth = pipeline.loss.depth
    mtp = torch.zeros(depth, device=device)
    for r in records:
        mtp = mtp + r.depths if r.depths is not None else mtp
    scalars = [loss] if z is None else [loss, z]
    parts = [torch.stack(scalars), moe.flatten(), per_source.flatten(), mtp]
    totals = torch.cat([t.double() for t in parts])
    torch_dist.all_reduce(totals, group=pipeline.group)
    n_scalar, n_moe, n_source = len(scalars), moe.numel(), per_source.numel()
    rest = n_scalar + n_moe + n_source
    return StageTotals(
        loss=totals[0].float(),
        z=totals[1].float() if with_z else None,
        moe=totals[n_scalar : n_scalar + n_moe].float().view(moe_shape) if moe_shape else None,
        sources=totals[n_scalar + n_moe : rest].view(2, len(sources)) if sources else None,
        mtp=totals[rest:].float() if depth else None,
    )
