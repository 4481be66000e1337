"""The pipeline part of ``build_model_and_optim``: this rank's stage modules, then the
schedule that drives them and the group that sums a tied embedding's two gradients."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forge.config.sections import DistributedConfig
from forge.model.chunked_loss import LossSpec
from forge.model.transformer import Transformer
from forge.parallel.pipeline import rank_stage_modules, tied_weight
from forge.parallel.pipeline_loss import StageLoss
from forge.parallel.stages import local_stages, stage_rank
from forge.training.context import DistContext, PipelineContext, RunContext


def pipeline_parts(
    model: nn.Module, cfg: DistributedConfig, pp_mesh: DeviceMesh
) -> list[Transformer]:
    """The stage modules this pipeline rank holds (``rank_stage_modules``), each still on the
    meta device: each is then parallelized and materialized on its own."""
    assert isinstance(model, Transformer), "a vision-language model has no pipeline stages"
    return rank_stage_modules(model, cfg, pp_mesh.get_local_rank())


def pipeline_of(
    run: RunContext,
    dist: DistContext,
    stages: Sequence[Transformer],
    pp_mesh: DeviceMesh,
    loss: LossSpec,
) -> PipelineContext:
    """This rank's ``stages`` in their schedule, the last stage computing ``loss``; the
    two ends of an embedding tied across pipeline ranks (``tied_weight``)."""
    # here, not at the top: torch's pipelining imports its compiler, which only a pipeline
    # run needs (forge.parallel.schedules)
    from forge.parallel.schedules import build_schedule

    cfg, d = run.config, run.config.distributed
    rank, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    kind, per_rank = d.pp_schedule, d.pp_stages_per_rank
    indices = local_stages(kind, d.pp, per_rank, rank)
    stage_loss = StageLoss(loss, cfg.model.moe, cfg.model.mtp_depth)
    schedule = build_schedule(
        list(zip(indices, stages, strict=True)),
        d.n_stages,
        dist.device,
        group,
        kind,
        cfg.train.grad_accum_steps,
        stage_loss,
    )
    assert dist.mesh is not None
    last_rank = stage_rank(kind, d.pp, per_rank, d.n_stages - 1)
    timeout_s = cfg.distributed.timeout_s
    tied = tied_weight(stages, dist.mesh, group, rank, last_rank, timeout_s)
    accum = cfg.train.grad_accum_steps
    return PipelineContext(schedule, group, indices, d.n_stages, accum, stage_loss, tied)
