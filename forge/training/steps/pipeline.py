"""The pipeline step, and the one place that drives this rank's stage through a schedule
(training and evaluation alike)."""

from __future__ import annotations

import enum

import torch
import torch.distributed as torch_dist

from forge.data.loader import Batch
from forge.model.chunked_loss import LossSpec
from forge.parallel.grad_norm import global_grad_norm
from forge.parallel.pipeline import head_kwargs
from forge.training.context import PipelineContext
from forge.training.steps.common import (
    StepTotals,
    finish_step,
    set_lr,
    step_lr,
    trainable_parameters,
)
from forge.training.steps.spec import StepFunction, StepSpec
from forge.types import LoopState, StepResult


class Pass(enum.Enum):
    """What a schedule run does: forward and backward (``step``), or forward only (``eval``)."""

    TRAIN = "train"
    EVAL = "eval"


def run_stage(
    pipeline: PipelineContext, batches: list[Batch] | tuple[Batch, ...], loss: LossSpec, mode: Pass
) -> None:
    """Run ``batches`` (concatenated; the schedule splits them again, one per pipeline
    micro-batch) through this rank's stage: the first stage feeds the tokens, the last the
    labels (and, with a chunked ``loss``, computes it chunk by chunk), the others neither."""
    run = pipeline.schedule.step if mode is Pass.TRAIN else pipeline.schedule.eval
    if pipeline.is_first:
        run(torch.cat([b.inputs for b in batches]))
    elif pipeline.is_last:
        labels = torch.cat([b.labels for b in batches])
        run(target=labels, losses=[], return_outputs=False, **head_kwargs(labels, loss))
    else:
        run()


def make_pipeline_step(spec: StepSpec, pipeline: PipelineContext) -> StepFunction:
    """One optimizer step through the pipeline (``run_stage``).

    The loss (known on the last stage) reaches every rank by a sum over the pipeline group;
    the grad norm is global across stages, so every rank takes the same finite/skip branch.
    A mixture-of-experts model's statistics (``spec.moe_shape``) travel through the stages
    with the hidden states and reach every stage the same way.
    """
    stage = spec.model

    def pipeline_step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        lr = set_lr(spec.optimizer, step_lr(spec, state, batches))
        stage.train()
        params = trainable_parameters(stage)  # a freeze schedule may change them
        run_stage(pipeline, batches, spec.loss, Pass.TRAIN)
        n = len(batches)
        loss, moe = stage_totals(pipeline, n, next(stage.parameters()).device, spec.moe_shape)
        totals = StepTotals(
            loss=loss,
            grad_norm=global_grad_norm(params, pipeline.group),
            params=params,
            tokens=sum(b.num_tokens for b in batches) * spec.dp_size,
            micro_batches=n,
            moe=moe,
        )
        return finish_step(spec, totals, state.step + 1, lr)

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
