"""The immutable contexts the setup phases build. Torch objects live inside as handles."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import attrs
import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import _PipelineSchedule

from forge.checkpoint.resume import ResumePlan
from forge.config.sections import JobConfig
from forge.data.loader import Batch, TextLoader
from forge.data.shards import Manifest
from forge.model.chunked_loss import PLAIN_LOSS, LossSpec
from forge.optim.freezing import Freezer
from forge.optim.schedules import Schedule
from forge.parallel.mesh import coordinates
from forge.parallel.pipeline import StageLoss
from forge.parallel.world import MeshDims, WorldInfo
from forge.training.plan import LoopPolicy, loop_policy
from forge.training.run_dir import checkpoint_dir_of
from forge.types import LoopState


@attrs.frozen
class RunContext:
    """A validated config, where the run writes, and the loop's policy (from the config)."""

    config: JobConfig
    config_source: pathlib.Path
    run_dir: pathlib.Path
    checkpoint_dir: pathlib.Path
    policy: LoopPolicy = attrs.field(
        default=attrs.Factory(lambda self: loop_policy(self.config), takes_self=True)
    )

    @classmethod
    def of(cls, config: JobConfig, source: pathlib.Path) -> RunContext:
        """The context of a loaded config (``run.dir`` resolved by ``load_config``)."""
        run_dir = pathlib.Path(str(config.run.dir))
        return cls(config, source, run_dir, checkpoint_dir_of(config, run_dir))

    @property
    def metrics_path(self) -> pathlib.Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def export_dir(self) -> pathlib.Path:
        return self.run_dir / "export"


@attrs.frozen
class DistContext:
    """This process's place in the world and the mesh (None for a single process)."""

    world: WorldInfo = attrs.Factory(WorldInfo)
    dims: MeshDims = attrs.Factory(MeshDims)
    mesh: DeviceMesh | None = None
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def is_main(self) -> bool:
        return self.world.rank == 0

    @property
    def coords(self) -> dict[str, int]:
        return coordinates(self.world.rank, self.dims)

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data slice: ranks that differ only in pp or tp share it."""
        c = self.coords
        return c["dp_replicate"] * self.dims.dp_shard + c["dp_shard"]

    @property
    def dp_size(self) -> int:
        return self.dims.dp


@attrs.frozen
class PipelineContext:
    """This rank's pipeline stage and the schedule that drives it."""

    schedule: _PipelineSchedule
    group: ProcessGroup
    stage_index: int
    n_stages: int
    loss: StageLoss = attrs.Factory(StageLoss)  # the last stage's loss function

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.n_stages - 1


@attrs.frozen
class ModelContext:
    """The (parallelized) model or this rank's pipeline stages, and its optimizer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    num_params: int
    fsdp: bool = False  # FSDP2 applies the compute dtype itself (no autocast)
    pipeline: PipelineContext | None = None  # set when distributed.pp > 1
    compiled: bool = False  # blocks and loss chunks go through torch.compile
    freezer: Freezer | None = None  # the trainable set, following [[freeze]] (all without)
    # how the loss is computed, train and eval: build_model_and_optim sets ``loss_spec_of``
    # the config (a hand-built context gets the plain loss unless it passes its own)
    loss: LossSpec = PLAIN_LOSS
    peak_lr: float | None = None  # the schedule's peak LR; None: the config's optimizer.lr


@attrs.frozen
class DataContext:
    """The run's loaders and what the checkpoint records of its data."""

    manifest: Manifest  # the first source's
    train_loader: TextLoader
    eval_loader: TextLoader | None
    source_names: tuple[str, ...] = ()  # a mixture's sources, whose losses the step reports
    fingerprints: tuple[str, ...] = ()  # each source's dataset_fingerprint, in source order


@attrs.frozen
class CheckpointContext:
    """Where the loop starts: the resume plan and the state it restored; with
    ``checkpoint.schedule_from = "checkpoint"``, the recorded LR schedule and its peak."""

    plan: ResumePlan
    initial_state: LoopState
    schedule: Schedule | None = None
    peak_lr: float | None = None

    def applied_to(self, model: ModelContext) -> ModelContext:
        """``model`` with the recorded schedule in place of the configured one, if kept."""
        if self.schedule is None:
            return model
        return attrs.evolve(model, schedule=self.schedule, peak_lr=self.peak_lr)


StepBatches = Iterator[tuple[Batch, ...]]
