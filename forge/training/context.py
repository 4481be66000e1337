"""The immutable contexts the setup phases build. Torch objects live inside as handles."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from forge.checkpoint.costs import ResumeCost
from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.resume import ResumePlan
from forge.config.sections import JobConfig
from forge.data.batch import Batch
from forge.data.loader import TextLoader
from forge.data.shards import Manifest
from forge.model.chunked_loss import PLAIN_LOSS, LossSpec
from forge.optim.freezing import Freezer
from forge.optim.schedules import Schedule
from forge.parallel.mesh import coordinates, data_parallel_mesh
from forge.parallel.pipeline import TiedWeight
from forge.parallel.pipeline_loss import StageLoss
from forge.parallel.world import MeshDims, WorldInfo
from forge.training.loop.plan import LoopPolicy, loop_policy
from forge.training.records.run_dir import checkpoint_dir_of, group_dir
from forge.types import LoopState

if TYPE_CHECKING:  # torch's pipelining imports its compiler: only a pipeline run does
    from torch.distributed.pipelining.schedules import _PipelineSchedule


@attrs.frozen
class RunContext:
    """A validated config, where the run writes, and the loop's policy (from the config)."""

    config: JobConfig
    config_source: pathlib.Path
    run_dir: pathlib.Path
    checkpoint_dir: CheckpointPath  # a local path or an object-store prefix
    policy: LoopPolicy = attrs.field(
        default=attrs.Factory(lambda self: loop_policy(self.config), takes_self=True)
    )

    @classmethod
    def of(cls, config: JobConfig, source: pathlib.Path) -> RunContext:
        """The context of a loaded config (``run.dir`` resolved by ``load_config``)."""
        run_dir = pathlib.Path(str(config.run.dir))
        ft = config.fault_tolerance
        if ft.enabled:  # each replica group is a launch of its own, with its own records
            run_dir = run_dir / group_dir(ft.group)
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
    hosts: tuple[str, ...] = ()  # each rank's host name, in rank order (empty: unknown)

    def host(self, rank: int) -> str:
        """Rank ``rank``'s host name, as its own process sees it ("?" when unknown)."""
        return self.hosts[rank] if rank < len(self.hosts) else "?"

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def is_main(self) -> bool:
        return self.world.rank == 0

    def say(self, line: str) -> None:
        """A ``[forge]`` line on stderr from rank 0; nothing elsewhere."""
        if self.is_main:
            print(f"[forge] {line}", file=sys.stderr)

    @property
    def coords(self) -> dict[str, int]:
        return coordinates(self.world.rank, self.dims)

    @property
    def dp_rank(self) -> int:
        """Index of this rank's rows: ranks that differ only in pp, cp or tp share them."""
        c = self.coords
        return c["dp_replicate"] * self.dims.dp_shard + c["dp_shard"]

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def data_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: ``dp_replicate × dp_shard × cp`` (None: one process)."""
        return data_parallel_mesh(self.mesh)

    @property
    def context_split(self) -> tuple[int, int]:
        """``(rank, cp)``: which of the ``cp`` context-parallel parts of each row is this
        rank's (``(0, 1)``: whole rows)."""
        return self.coords["cp"], self.dims.cp

    @property
    def token_slices(self) -> int:
        """Ranks that hold distinct tokens of a step (``dp × cp``): losses and label counts
        are summed over them."""
        return self.dims.token_slices


@attrs.frozen
class PipelineContext:
    """This rank's pipeline stages (``stage_indices`` of ``n_stages`` over all ranks) and the
    schedule that drives them; the last stage's loss function; this rank's end of an
    embedding tied across pipeline ranks (None: untied, or both ends on this rank).
    ``n_microbatches``: the micro-batches one run of the schedule takes
    (``train.grad_accum_steps``)."""

    schedule: _PipelineSchedule
    group: ProcessGroup
    stage_indices: tuple[int, ...]
    n_stages: int
    n_microbatches: int
    loss: StageLoss = attrs.Factory(StageLoss)  # the last stage's loss function
    tied: TiedWeight | None = None

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (it feeds the tokens)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss)."""
        return self.n_stages - 1 in self.stage_indices


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
    # FP8 fell back to high precision before this launch (float8_on_drift = "fallback",
    # ``kept_fallback``): its layers compute in high precision, and no step is checked
    float8_fallen_back: bool = False


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
    resume_cost: ResumeCost | None = None  # this rank's, when a checkpoint was loaded
    # the step the run's records went to, when this start goes back from it on purpose
    # (``checkpoint.allow_rewind``; recorded by ``prepare_run_dir``)
    rewound_from: int | None = None

    def applied_to(self, model: ModelContext) -> ModelContext:
        """``model`` with the recorded schedule in place of the configured one, if kept."""
        if self.schedule is None:
            return model
        return attrs.evolve(model, schedule=self.schedule, peak_lr=self.peak_lr)


StepBatches = Iterator[tuple[Batch, ...]]
