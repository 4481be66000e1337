"""Held-out loss for every kind of step (text, vision-language, pipeline) and its reduction
over ranks: what the loop's ``evaluate`` effect and ``scripts/eval.py`` report."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch
import torch.distributed as torch_dist
from torch import nn

from forge.config.sections import Precision
from forge.data.batch import Batch
from forge.data.packing import IGNORE_INDEX
from forge.model.chunked_loss import PLAIN_LOSS, LossSpec
from forge.model.moe import LOADS
from forge.model.precision import autocast_for, device_type_of
from forge.optim.optimizers import evaluation_weights
from forge.parallel.reduce import sum_over_ranks
from forge.training.context import DistContext, ModelContext, PipelineContext
from forge.training.steps.common import micro_batch_loss
from forge.training.steps.pipeline import Pass, run_stage


@attrs.frozen
class EvalTotals:
    """Held-out sums over some batches: the summed loss over the unmasked labels, their
    number, and a mixture-of-experts model's tokens per expert ``(MoE layers, E)``."""

    loss_sum: float
    count: int
    moe_loads: list[list[float]] | None = None

    @property
    def mean(self) -> float:
        """The mean loss per label (0 labels: the sum itself)."""
        return self.loss_sum / max(self.count, 1)


@torch.no_grad()
def evaluate_totals(
    model: nn.Module,
    batches: Iterable[Batch],
    precision: Precision,
    loss_spec: LossSpec = PLAIN_LOSS,
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


def totals_over_ranks(
    totals: EvalTotals, world_size: int, device: torch.device | str = "cpu", dp_size: int = 0
) -> EvalTotals:
    """Every data slice's ``totals`` summed (one all-reduce over every rank, which counts a
    slice once per rank holding it: tensor-parallel peers; divided back by that number
    ``world_size / dp_size``, all of the world when ``dp_size`` is 0)."""
    flat_loads = [x for layer in totals.moe_loads or [] for x in layer]
    summed = sum_over_ranks([totals.loss_sum, float(totals.count), *flat_loads], world_size, device)
    copies = world_size // dp_size if dp_size else 1
    summed = [v / copies for v in summed]  # each is the sum of `copies` equal values
    loads = None
    if totals.moe_loads is not None:
        width = len(totals.moe_loads[0])
        rest = summed[2:]
        loads = [rest[i : i + width] for i in range(0, len(rest), width)]
    return EvalTotals(summed[0], round(summed[1]), loads)


@torch.no_grad()
def evaluate_pipeline_totals(
    stage: nn.Module,
    pipeline: PipelineContext,
    batches: list[Batch],
    n_microbatches: int,
    loss_spec: LossSpec = PLAIN_LOSS,
) -> EvalTotals:
    """``EvalTotals`` over ``batches`` run forward-only through the pipeline, on every stage
    (the last stage's sums, added over the pipeline group), so that ranks combine them as
    ``evaluate_totals``'s: the loss per label over every batch, packed or not.

    Batches are concatenated in groups of ``n_microbatches`` (the schedule's split); a partial
    group at the end is left out.
    """
    was_training = stage.training
    stage.eval()
    pipeline.loss.weigh(None)  # every micro-batch as it is: the sums weigh the labels
    device = next(stage.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, labels
    for start in range(0, len(batches) - n_microbatches + 1, n_microbatches):
        run_stage(pipeline, batches[start : start + n_microbatches], loss_spec, Pass.EVAL)
        for r in pipeline.loss.take(n_microbatches):
            sums += torch.stack([(r.ce * r.labels).double(), r.labels.double()])
    stage.train(was_training)
    torch_dist.all_reduce(sums, group=pipeline.group)
    total, count = sums.tolist()
    return EvalTotals(total, round(count))


def held_out_loss(
    model: ModelContext, dist: DistContext, batches: list[Batch], precision: Precision, n_micro: int
) -> tuple[float, list[list[float]] | None]:
    """The mean held-out loss over ``batches`` and every rank, under the optimizer's
    evaluation weights (Schedule-Free: the average), and a mixture of experts' tokens per
    expert of each MoE layer, summed over ranks (None in a pipeline, whose stages run
    ``n_micro`` micro-batches at a time)."""
    with evaluation_weights(model.optimizer):
        if model.pipeline is not None:
            totals = evaluate_pipeline_totals(
                model.model, model.pipeline, batches, n_micro, model.loss
            )
            summed = totals_over_ranks(totals, dist.world_size, dist.device, dist.token_slices)
            return summed.mean, None
        totals = evaluate_totals(model.model, batches, precision, model.loss)
    summed = totals_over_ranks(totals, dist.world_size, dist.device, dist.token_slices)
    return summed.mean, summed.moe_loads
