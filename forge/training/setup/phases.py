"""The named setup phases. Each takes contexts and returns a new one; a notebook can call them
one by one and inspect what each built.

Order: ``load_and_validate_config`` → ``setup_distributed`` → ``build_model_and_optim`` →
``setup_data`` → ``claim_run_dir`` → ``setup_checkpointing`` → ``prepare_run_dir``; then the
step (``forge.training.steps``), the loop and ``conclude`` (``forge.training.loop.loop``) and
``teardown``. Nothing is written to disk before ``claim_run_dir`` (which creates and locks
the run directory, removed again if set-up then fails): bad input leaves no run directory.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch

from forge.checkpoint.resume import ResumeSource, resolve_resume
from forge.checkpoint.store import load_checkpoint, read_train_state, remove_stale_temporaries
from forge.config.absolute import launch_folder, recorded_text, with_absolute_paths
from forge.config.loader import ConfigError, load_config_checked, unstructure_config
from forge.config.sections import Precision
from forge.config.toml_writer import dumps_toml
from forge.data.shards import dataset_fingerprint, read_manifest
from forge.interop.export_rules import export_caveats
from forge.model.chunked_loss import loss_spec_of
from forge.model.transformer import num_parameters
from forge.model.vlm import build_model
from forge.optim.freezing import Freezer, freeze_for_step
from forge.optim.param_groups import build_optimizer
from forge.optim.schedules import resolve_schedule
from forge.parallel.float8 import float8_start_line, gathers_in_float8
from forge.parallel.mesh import (
    broadcast_from_main,
    device_for,
    end_process_group,
    expert_meshes,
    host_names,
    init_process_group,
    submesh,
)
from forge.parallel.parallelize import parallelize
from forge.parallel.pipeline import rank_model
from forge.parallel.stages import splits_backward
from forge.parallel.world import (
    local_gpu_problem,
    resolve_dims,
    shared_store_problem,
    world_info,
)
from forge.training.context import (
    CheckpointContext,
    DataContext,
    DistContext,
    ModelContext,
    RunContext,
)
from forge.training.loop.plan import starting_outcome
from forge.training.records.resume import RunMismatchError, records_ahead, resume_run
from forge.training.records.resume_rules import changes
from forge.training.records.run_dir import (
    RunDirBusyError,
    RunDirLock,
    foreign_records_problem,
    load_path_of,
    lock_directories,
)
from forge.training.records.run_record import predated_model_defaults, run_identity
from forge.training.records.run_records import (
    RunRecordsError,
    recorded_configs,
    unrecorded_configs_note,
    write_run_records,
)
from forge.training.setup.loaders import image_caption_loaders, text_loaders
from forge.training.setup.pipeline_setup import pipeline_of, pipeline_parts
from forge.training.setup.problems import (
    UNVERIFIED_DATA,
    cpu_flags,
    memory_problems,
    precision_warning,
)
from forge.training.setup.world_checks import WORLD_CHECKS, run_directories
from forge.training.steps.replay import (
    cuda_determinism_env,
    deterministic_line,
    use_deterministic_kernels,
)
from forge.types import LoopState


def load_and_validate_config(
    argv: Sequence[str], checked: Callable[[Sequence[str]], None] = lambda problems: None
) -> RunContext:
    """Parse ``[config.toml, --overrides...]``, validate it against the data on disk.

    Raises ``ConfigError`` listing every problem of every stage in one pass (types, ranges,
    combinations, then the world: the export, layout, data, hooks, freeze, vision, sinks,
    directories; the memory estimate once all else holds); reads files but writes none.
    ``checked`` is called with the config's own problems before the world is asked (the
    train script handles there the signals it held since its start).
    """
    loaded, problems, broken = load_config_checked(argv)
    checked(problems)
    run = RunContext.of(loaded.config, loaded.source)
    world = world_info(os.environ)
    for reads, check in WORLD_CHECKS:
        if not reads & broken:
            problems += check(run, world)
    if not problems:
        problems += memory_problems(run.config, world)
    if problems:
        raise ConfigError(problems)
    return run


def setup_distributed(run: RunContext) -> DistContext:
    """World info (torchrun, SLURM or one process), process group, device mesh and seeding.

    Each rank seeds its own RNG streams (``train.seed + rank``); model weights do not depend on
    them (``initial_value`` uses a generator per parameter), so every layout starts alike.
    """
    cfg = run.config
    if (problem := shared_store_problem(os.environ)) is not None:
        raise ConfigError(problem)
    world = world_info(os.environ)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (problem := local_gpu_problem(world.local_rank, gpus)) is not None:
        raise ConfigError(problem)
    replays = cfg.resilience.replay_interval or cfg.resilience.replay_first_step
    if gpus and (replays or cfg.train.deterministic):
        cuda_determinism_env(os.environ)  # before CUDA starts: bit for bit across launches
    if cfg.train.deterministic:
        use_deterministic_kernels()
    dims = resolve_dims(cfg.distributed, world.world_size)
    mesh = init_process_group(world, cfg.distributed, dims)
    # weights come from per-parameter generators (initial_value); these streams differ per rank
    seed_everything(cfg.train.seed + world.rank)
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    device = device_for(world)  # first: the gather of host names runs on it under NCCL
    dist = DistContext(world=world, dims=dims, mesh=mesh, device=device, hosts=host_names(world))
    if cfg.train.deterministic:
        dist.say(deterministic_line(dist.device.type))
    warning = precision_warning(run.config.train.mixed_precision, dist.device.type, cpu_flags())
    if warning and dist.is_main:
        print(f"[forge] warning: {warning}", file=sys.stderr)
    return dist


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (model init and any sampling draw from these)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model_and_optim(run: RunContext, dist: DistContext) -> ModelContext:
    """The model (fp32, or bf16 under ``train.param_dtype``), parallelized (TP → AC → FSDP2 →
    compile), the configured optimizer with param groups over the parallelized parameters,
    and the resolved LR schedule.

    The model is built on the meta device, parallelized, then materialized: each rank allocates
    only its shards and initializes them from per-parameter generators, so a sharded run starts
    from exactly the weights of a one-process run, and a model larger than one device fits.
    Under ``distributed.pp > 1`` each of the rank's stages is parallelized and materialized
    on its own; ``rank_model`` holds their parameters under the full model's names.
    """
    cfg = run.config
    tp_mesh, dp_mesh = submesh(dist.mesh, "tp"), dist.data_mesh  # dp_replicate × dp_shard × cp
    gathered = gathers_in_float8(cfg, fsdp=dp_mesh is not None)
    if (line := float8_start_line(cfg.train.float8, cfg.model, dist.device, gathered)) is not None:
        dist.say(line)
    with torch.device("meta"):  # no memory until sharded: each rank materializes its part
        model = build_model(cfg.model)
    if cfg.train.param_dtype is Precision.BF16:  # pure bf16: allocated (and sharded) as bf16
        model.to(dtype=torch.bfloat16)
    num_params = num_parameters(model)
    pp_mesh = submesh(dist.mesh, "pp")
    stages = None if pp_mesh is None else pipeline_parts(model, cfg.distributed, pp_mesh)
    compiled = cfg.train.compile_enabled(dist.device.type, cxx_compiler_found())
    compiled = compiled and not splits_backward(dist.dims.pp, cfg.distributed.pp_schedule)
    ep_mesh, experts_mesh = expert_meshes(dist.mesh, dist.dims)
    for part in [model] if stages is None else stages:  # each stage is a root of its own
        parallelize(
            part,
            tp_mesh=tp_mesh,
            dp_mesh=dp_mesh,
            cp_mesh=submesh(dist.mesh, "cp"),
            precision=cfg.train.mixed_precision,
            activation_checkpointing=cfg.train.activation_checkpointing,
            compile_blocks=compiled,
            param_dtype=cfg.train.param_dtype,
            ep_mesh=ep_mesh,
            experts_mesh=experts_mesh,
            float8=cfg.train.float8,
            emulate_float8=dist.device.type != "cuda",
            float8_all_gather=gathered,
        )
        part.materialize(dist.device)
    model = model if stages is None else rank_model(stages)
    model.init_weights(seed=cfg.train.seed)
    if cfg.freeze:  # the optimizer starts with step 1's trainable parameters only
        freeze_for_step(model, cfg.freeze, 1)
    optimizer = build_optimizer(model, cfg.optimizer)
    loss = loss_spec_of(cfg, compiled)
    pipeline = None
    if pp_mesh is not None and stages is not None:
        pipeline = pipeline_of(run, dist, stages, pp_mesh, loss)
    return ModelContext(
        model=model,
        optimizer=optimizer,
        schedule=resolve_schedule(cfg.scheduler, cfg.train.max_steps),
        num_params=num_params,
        fsdp=dist.data_mesh is not None,
        pipeline=pipeline,
        compiled=compiled,
        freezer=Freezer(model, optimizer, cfg.freeze, cfg.optimizer),
        loss=loss,
    )


def cxx_compiler_found() -> bool:
    """Whether inductor's CPU backend has a C++ compiler (``$CXX``, else ``c++``/``g++``)."""
    return any(shutil.which(n) for n in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if n)


def setup_data(run: RunContext, dist: DistContext) -> DataContext:
    """Memory-mapped train (and eval) examples of every source and the stateful loaders:
    token windows, or image–caption examples under ``model.vlm``."""
    cfg = run.config
    sources = cfg.data.source_list
    folders = [pathlib.Path(s.path) for s in sources]
    manifests = [read_manifest(folder) for folder in folders]
    place = {"dp_rank": dist.dp_rank, "dp_size": dist.dp_size, "device": dist.device}
    if cfg.model.vlm is not None:
        loaders = image_caption_loaders(cfg, folders[0], manifests[0], **place)
    else:
        loaders = text_loaders(cfg, folders, manifests, **place, context=dist.context_split)
    if loaders.warning is not None:
        dist.say(f"warning: {loaders.warning}")
    if not cfg.data.verify_checksum:
        dist.say(UNVERIFIED_DATA)
    names = tuple(s.name for s in sources)
    return DataContext(
        fingerprints=tuple(dataset_fingerprint(m) for m in manifests),
        manifest=manifests[0],
        train_loader=loaders.train,
        eval_loader=loaders.held_out,
        source_names=names if len(names) > 1 else (),
    )


def claim_run_dir(run: RunContext, dist: DistContext) -> RunDirLock:
    """Create and lock the run (and checkpoint) directory for this run; a second process on
    either gets ``RunDirBusyError`` naming the holder. Rank 0 holds the lock; every rank
    raises the same error, so none enters training alone."""
    lock, lines = RunDirLock(), None
    if dist.is_main:
        try:
            lock = lock_directories(run_directories(run))
        except RunDirBusyError as exc:
            lines = exc.lines
    lines = broadcast_from_main(lines, dist.world_size)
    if lines:
        raise RunDirBusyError(lines)  # type: ignore[arg-type]
    return lock


def setup_checkpointing(
    run: RunContext, dist: DistContext, model: ModelContext, data: DataContext
) -> CheckpointContext:
    """Resolve where the run starts and restore that state into the model, optimizer and loader.

    Each candidate checkpoint is checked whole (files, train state, the run identity) before
    any tensor is loaded; a damaged one gives way to the next older one.
    """
    cfg = run.config.checkpoint
    plan = resolve_resume(run.checkpoint_dir, load_path_of(run.config))
    say = dist.say
    for caveat in export_caveats(run.config.model) if cfg.export_final else ():
        say(f"warning: checkpoint.export_final: {caveat}")
    for path in plan.skipped:
        say(f"skipping incomplete checkpoint {path}")
    if plan.latest_note is not None:
        say(f"warning: {plan.latest_note}")
    if plan.source is ResumeSource.CHECKPOINT_DIR and plan.path is not None:
        return resume_run(run, dist, model, data, plan, say)
    if plan.source is not ResumeSource.LOAD_PATH or plan.path is None:
        problem = foreign_records_problem(run.run_dir, run.checkpoint_dir, run.config)
        if problem is not None:  # another run's records: the more telling refusal
            raise RunMismatchError(problem)
    rewound_from = records_ahead(run, dist, plan, say)
    if plan.source is ResumeSource.LOAD_PATH and plan.path is not None:
        optimizer = model.optimizer if cfg.load_optimizer else None
        load_checkpoint(
            plan.path,
            model.model,
            optimizer,
            rank=dist.rank,
            restore_rng_state=False,
            verify=cfg.verify,
        )
        recorded = read_train_state(plan.path).get("identity")
        differences = changes(
            recorded if isinstance(recorded, dict) else {},
            run_identity(run.config, dist.dp_size, data.fingerprints),
            predated_model_defaults(),
        )
        say(f"initial weights from {plan.path}")
        for difference in differences:
            say(f"  differs from the run that wrote it: {difference.describe()}")
    return CheckpointContext(plan=plan, initial_state=LoopState(), rewound_from=rewound_from)


def prepare_run_dir(run: RunContext, dist: DistContext, ckpt: CheckpointContext) -> None:
    """Record the resolved config (``config.toml``, or ``config.step_N.toml`` for a resume
    that changed it: ``forge.training.records.run_records``) and align ``metrics.jsonl`` with the
    resumed step (records past it came from a run that crashed after its checkpoint). A run
    that is already complete changes nothing on disk. Raises ``RunRecordsError`` on every
    rank when rank 0 cannot write them."""
    if starting_outcome(ckpt.initial_state, run.policy) is not None:
        return
    problem = None
    if dist.is_main:
        # local paths absolute: a reader started in another folder finds what the run read
        cwd = launch_folder(os.environ)
        text = dumps_toml(unstructure_config(with_absolute_paths(run.config, cwd)))
        step = ckpt.initial_state.step
        note = unrecorded_configs_note(recorded_configs(run.run_dir), step)
        problem = write_run_records(
            run.run_dir, run.metrics_path, step, text, ckpt.rewound_from,
            lambda recorded: recorded_text(recorded, cwd),
        )  # fmt: skip
        if problem is None and note is not None:
            dist.say(f"warning: run.dir: {note}")
        if problem is None:
            remove_stale_temporaries(run.checkpoint_dir)
    problem = broadcast_from_main(problem, dist.world_size)
    if isinstance(problem, str):
        raise RunRecordsError(problem)


def teardown(dist: DistContext, healthy: bool = True) -> None:
    """Barrier, destroy the process group (if one was started), flush output. After a health
    failure the barrier is skipped: a peer may be gone.

    With more than one rank the caller should then end the process with ``os._exit``: gloo
    worker threads kept alive by the mesh can abort interpreter finalization.
    """
    if dist.world_size > 1 and healthy:
        end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
