"""The schedules of ``torch.distributed.pipelining`` that drive a rank's stages, and
evaluation through the V schedules.

Its own module because importing ``torch.distributed.pipelining`` imports torch's compiler
(0.4 s per process here): only a run with ``distributed.pp > 1`` pays for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineSchedule

from forge.config.sections import PipelineSchedule
from forge.model.transformer import Transformer
from forge.parallel.pipeline_loss import StageLoss
from forge.parallel.stages import is_multi_stage

SCHEDULES: dict[PipelineSchedule, type[_PipelineSchedule]] = {
    PipelineSchedule.GPIPE: ScheduleGPipe,
    PipelineSchedule.ONE_F_ONE_B: Schedule1F1B,
    PipelineSchedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    PipelineSchedule.INTERLEAVED_ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
    PipelineSchedule.ZBV: ScheduleZBVZeroBubble,
    PipelineSchedule.DUALPIPEV: ScheduleDualPipeV,
}


def build_schedule(
    stages: Sequence[tuple[int, Transformer]],
    n_stages: int,
    device: torch.device,
    group: ProcessGroup,
    kind: PipelineSchedule,
    n_microbatches: int,
    loss_fn: StageLoss,
) -> _PipelineSchedule:
    """The schedule that runs one optimizer step's micro-batches through this rank's
    ``(stage index, module)`` pairs: one stage object for a single-stage schedule, a list for
    a multi-stage one (a mismatch is an error, not a silent fallback).

    Gradients are summed over micro-batches (``scale_grads=False``): ``StageLoss`` weighs
    each micro-batch's objective by its share of the step's labels.
    """
    pipe = [PipelineStage(m, i, n_stages, device, group=group) for i, m in stages]
    schedule = SCHEDULES[kind]
    if is_multi_stage(kind):
        return schedule(pipe, n_microbatches, loss_fn=loss_fn, scale_grads=False)  # type: ignore[call-arg]
    if len(pipe) != 1:
        raise ValueError(
            f"distributed.pp_schedule={kind.value!r} runs one stage per rank, this rank has "
            f"{len(pipe)}"
        )
    return schedule(pipe[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)  # type: ignore[call-arg]


FORWARD_ACTIONS = frozenset(
    {
        _ComputationType.FORWARD,
        _ComputationType.SEND_F,
        _ComputationType.RECV_F,
        _ComputationType.UNSHARD,
        _ComputationType.RESHARD,
    }
)


def forward_actions(actions: Sequence[_Action]) -> list[_Action]:
    """A rank's lowered actions without the backward ones (an overlapped forward-backward
    keeps its forward): the forwards keep their order, and so their sends and receives."""
    out: list[_Action] = []
    for action in actions:
        parts = action.sub_actions if action.sub_actions is not None else (action,)
        out += [a for a in parts if a.computation_type in FORWARD_ACTIONS]
    return out


@contextlib.contextmanager
def forward_only(schedule: _PipelineSchedule) -> Iterator[None]:
    """Evaluation through a V schedule (``zbv``, ``dualpipev``) with its forward actions
    only: torch 2.13 runs their backward actions in ``eval()`` too, and the hand-over of a
    gradient between the two stages of a rank fails there ("can't steal_bwd_input if this
    stage doesn't have backward"). Other schedules run as they are."""
    if not isinstance(schedule, ScheduleZBVZeroBubble | ScheduleDualPipeV):
        yield
        return
    order = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {r: forward_actions(a) for r, a in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order
