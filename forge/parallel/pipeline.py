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
from forge.model.chunked_loss import LossSpec
from forge.model.transformer import Transformer


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


def lm_loss_fn(
    output: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor
) -> torch.Tensor:
    """Per-micro-batch loss for the last stage (fp32 cross-entropy, mean over unmasked
    tokens): from the logits, or the objective the stage computed chunk by chunk
    (``head_kwargs``)."""
    if isinstance(output, tuple):
        return output[0]
    return F.cross_entropy(output.float().flatten(0, 1), labels.flatten())


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
) -> _PipelineSchedule:
    """The schedule that runs one optimizer step's micro-batches through the pipeline.

    Gradients are scaled by 1 / n_microbatches, so a step equals the mean over micro-batches,
    as in gradient accumulation without a pipeline.
    """
    pipe_stage = PipelineStage(stage, stage_index, n_stages, device, group=group)
    if kind is PipelineSchedule.GPIPE:
        return ScheduleGPipe(pipe_stage, n_microbatches, loss_fn=lm_loss_fn)
    if kind is PipelineSchedule.ONE_F_ONE_B:
        return Schedule1F1B(pipe_stage, n_microbatches, loss_fn=lm_loss_fn)
    raise ValueError(f"distributed.pp_schedule={kind.value!r} is not supported")
