"""What ``load_and_validate_config`` checks against the world beyond the config file, in
one table (``WORLD_CHECKS``): the export, the layout, the data, attention, hooks, the freeze
schedule, vision, the metric sinks, the run's directories, replica groups, downstream tasks
and the process group's backend. Every check runs in the same pass, so a start names every
problem at once; nothing is written."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

import torch

from forge.checkpoint.paths import CheckpointPath
from forge.config.sections import JobConfig
from forge.harness.tasks import downstream_problems
from forge.metrics.backends import sink_problems
from forge.parallel.mesh import backend_problem
from forge.parallel.world import WorldInfo, parallel_problems
from forge.training.context import RunContext
from forge.training.loop.hooks import hook_problems
from forge.training.records.run_dir import (
    groups_switch_problem,
    path_problem,
    record_file_problem,
)
from forge.training.setup.problems import (
    attention_problems,
    data_problems,
    export_final_problems,
    freeze_problems,
    replica_group_problems,
)
from forge.training.setup.vlm import vlm_problems


def run_dir_problems(run: RunContext) -> list[str]:
    """Why a directory the run writes cannot be one (the first only: the checkpoint
    directory usually lies inside the run directory), a record file in it is none, or it
    holds a run of the other kind."""
    for key, folder in run_directories(run):
        if (problem := path_problem(key, folder)) is not None:
            return [problem]
    if (problem := record_file_problem(run.run_dir)) is not None:
        return [problem]
    base, ft = pathlib.Path(str(run.config.run.dir)), run.config.fault_tolerance
    return [p] if (p := groups_switch_problem(base, ft.enabled)) is not None else []


def run_directories(run: RunContext) -> list[tuple[str, CheckpointPath]]:
    """The directories a run writes, with the config key that names each: the run directory
    and, when checkpointing is on or it holds checkpoints, the checkpoint directory."""
    dirs: list[tuple[str, CheckpointPath]] = [("run.dir", run.run_dir)]
    if run.config.checkpoint.enabled or run.checkpoint_dir.exists():
        dirs.append(("checkpoint.dir", run.checkpoint_dir))
    return dirs


def backend_problems(config: JobConfig, world: WorldInfo) -> list[str]:
    """Why ``distributed.backend`` cannot start this world's process group (one process
    starts none)."""
    if world.world_size == 1:
        return []
    problem = backend_problem(config.distributed.backend, torch.cuda.is_available())
    return [problem] if problem is not None else []


WorldCheck = Callable[[RunContext, WorldInfo], list[str]]

# (the sections a check reads, the check): every check runs in the same pass, except one that
# reads a section with a problem of its own (its values would mislead it)
WORLD_CHECKS: tuple[tuple[frozenset[str], WorldCheck], ...] = (
    (frozenset({"model", "checkpoint"}), lambda run, world: export_final_problems(run.config)),
    (
        frozenset({"distributed", "model", "train", "checkpoint", "eval"}),
        lambda run, world: [
            f"{k}: {m}" for k, m in parallel_problems(run.config, world.world_size)
        ],
    ),
    (frozenset({"data", "model"}), lambda run, world: data_problems(run.config)),
    (frozenset({"model", "train"}), lambda run, world: attention_problems(run.config)),
    (frozenset({"hooks"}), lambda run, world: hook_problems(run.config.hooks)),
    (frozenset({"model", "freeze"}), lambda run, world: freeze_problems(run.config)),
    (
        frozenset({"model", "train", "data", "checkpoint"}),
        lambda run, world: vlm_problems(run.config),
    ),
    (  # rank 0 alone logs: another node's packages and credentials do not matter
        frozenset({"metrics"}),
        lambda run, world: sink_problems(run.config, os.environ) if world.rank == 0 else [],
    ),
    (frozenset({"run", "checkpoint", "fault_tolerance"}), lambda run, w: run_dir_problems(run)),
    (
        frozenset({"fault_tolerance"}),
        lambda run, world: replica_group_problems(run.config, os.environ),
    ),
    (frozenset({"eval", "model", "distributed"}), lambda run, w: downstream_problems(run.config)),
    (frozenset({"distributed"}), lambda run, world: backend_problems(run.config, world)),
)
