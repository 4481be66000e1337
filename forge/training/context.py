"""The immutable contexts the setup phases build. Torch objects live inside as handles."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import attrs
import torch
from torch import nn

from forge.checkpoint.resume import ResumePlan
from forge.config.sections import JobConfig
from forge.data.loader import Batch, TextLoader
from forge.data.shards import Manifest
from forge.optim.schedules import Schedule
from forge.training.state import LoopState


@attrs.frozen
class RunContext:
    """A validated config and where the run writes."""

    config: JobConfig
    config_source: pathlib.Path
    run_dir: pathlib.Path
    checkpoint_dir: pathlib.Path

    @property
    def metrics_path(self) -> pathlib.Path:
        return self.run_dir / "metrics.jsonl"


@attrs.frozen
class DistContext:
    """This process's place in the world (one process until parallelism lands)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@attrs.frozen
class ModelContext:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    num_params: int


@attrs.frozen
class DataContext:
    manifest: Manifest
    train_loader: TextLoader
    eval_loader: TextLoader | None
    tokens_per_step: int


@attrs.frozen
class CheckpointContext:
    """Where the loop starts: the resume plan and the state it restored."""

    plan: ResumePlan
    initial_state: LoopState


StepBatches = Iterator[tuple[Batch, ...]]
