"""Pipeline parallelism with ``torch.distributed.pipelining``: stage split and schedules."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import _PipelineSchedule

from forge.config.sections import PipelineSchedule
from forge.data.packing import IGNORE_INDEX
from forge.model.chunked_loss import LossSpec
from forge.model.moe import moe_terms
from forge.model.transformer import Transformer, split_moe_output


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Contiguous, balanced layer ranges; earlier stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_module(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """A copy of ``model`` holding only stage ``stage``'s layers (global names kept); the
    embedding lives on the first stage, the final norm and head on the last."""
    keep = {str(i) for i in split_layers(model.cfg.n_layers, n_stages)[stage]}
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


class StageLoss:
    """The last stage's per-micro-batch loss: fp32 cross-entropy (mean over unmasked tokens)
    from the logits, or the objective the stage computed chunk by chunk (``head_kwargs``),
    plus a mixture-of-experts model's auxiliary losses (``moe_terms``).

    The schedule keeps only the objective; each micro-batch's cross-entropy and MoE
    statistics are kept here for the step to ``take`` (what ``micro_batch_loss`` returns
    outside a pipeline).
    """

    def __init__(
        self, moe: bool = False, moe_aux_weight: float = 0.0, moe_z_weight: float = 0.0
    ) -> None:
        self.moe = moe
        self.moe_weights = (moe_aux_weight, moe_z_weight)
        self._records: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        out, stats = split_moe_output(output, self.moe)
        if isinstance(out, tuple):  # (objective, per-token loss, z) of the chunked loss
            objective, per_token = out[0], out[1]
            ce = per_token.detach().sum() / (labels != IGNORE_INDEX).sum()
        else:
            objective = F.cross_entropy(out.float().flatten(0, 1), labels.flatten())
            ce = objective.detach()
        if stats is not None:
            objective = objective + moe_terms(stats, *self.moe_weights).objective
            stats = stats.detach()
        self._records.append((ce, stats))
        return objective

    def take(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The last ``n`` micro-batches' (cross-entropy, MoE statistics), forgetting all.

        Only the last ``n``: a schedule's first step also calls the loss on placeholder
        tensors to infer the backward's shapes, and that call's values are garbage.
        """
        records, self._records = self._records[-n:] if n > 0 else [], []
        return records


def head_kwargs(labels: torch.Tensor, loss: LossSpec) -> dict[str, Any]:
    """The last stage's keyword inputs: with a chunked loss the stage computes the loss from
    ``labels`` itself (the schedule splits them with the micro-batches)."""
    if not loss.chunked:
        return {}
    return {"labels": labels, "loss": loss}


def build_schedule(
    stage: Transformer,
    stage_index: int,
    n_stages: int,
    device: torch.device,
    group: ProcessGroup,
    kind: PipelineSchedule,
    n_microbatches: int,
    loss_fn: StageLoss,
) -> _PipelineSchedule:
    """The schedule that runs one optimizer step's micro-batches through the pipeline.

    Gradients are scaled by 1 / n_microbatches, so a step equals the mean over micro-batches,
    as in gradient accumulation without a pipeline.
    """
    pipe_stage = PipelineStage(stage, stage_index, n_stages, device, group=group)
    if kind is PipelineSchedule.GPIPE:
        return ScheduleGPipe(pipe_stage, n_microbatches, loss_fn=loss_fn)
    if kind is PipelineSchedule.ONE_F_ONE_B:
        return Schedule1F1B(pipe_stage, n_microbatches, loss_fn=loss_fn)
    raise ValueError(f"distributed.pp_schedule={kind.value!r} is not supported")
