"""The named setup phases. Each takes contexts and returns a new one; a notebook can call them
one by one and inspect what each built.

Order: ``load_and_validate_config`` → ``setup_distributed`` → ``build_model_and_optim`` →
``setup_data`` → ``claim_run_dir`` → ``setup_checkpointing`` → ``prepare_run_dir`` → the loop
→ ``conclude`` → ``teardown``. Nothing is written to disk before ``claim_run_dir`` (which
creates and locks the run directory, and removes it again if set-up then fails), so bad
input of any kind leaves no run directory behind.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import random
import shutil
import sys
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from torch import nn

from forge.checkpoint.policy import SaveSchedule
from forge.checkpoint.resume import ResumeSource, first_loadable, resolve_resume
from forge.checkpoint.store import (
    check_loadable,
    load_checkpoint,
    read_train_state,
    remove_stale_temporaries,
)
from forge.config.freeze import schedule_problems, trainable_names
from forge.config.loader import CONVERTER, ConfigError, load_config, unstructure_config
from forge.config.sections import FreezeRule, JobConfig, ModelConfig, Precision
from forge.config.toml_writer import dumps_toml
from forge.data.dataset import open_windows
from forge.data.loader import Batch, Sampling, TextLoader, single_source, step_batches
from forge.data.mixture import resolve_phases
from forge.data.shards import DataError, Manifest, dataset_fingerprint, read_manifest
from forge.metrics.backends import missing_sink_packages
from forge.metrics.sinks import trim_records_after
from forge.metrics.sources import SourceStats
from forge.model.moe import stats_width
from forge.model.transformer import Transformer, num_parameters
from forge.model.vlm import build_model
from forge.optim.freezing import Freezer, freeze_for_step, named_parameters
from forge.optim.param_groups import build_optimizer
from forge.optim.schedules import resolve_schedule
from forge.parallel.mesh import (
    broadcast_from_main,
    device_for,
    end_process_group,
    expert_meshes,
    init_process_group,
    submesh,
)
from forge.parallel.parallelize import parallelize
from forge.parallel.pipeline import StageLoss, build_schedule, stage_module
from forge.parallel.world import parallel_problems, resolve_dims, world_info
from forge.resilience.faults import NanInjector, faults_from_env
from forge.training.context import (
    CheckpointContext,
    DataContext,
    DistContext,
    ModelContext,
    PipelineContext,
    RunContext,
    StepBatches,
)
from forge.training.hooks import Hooks, hook_problems
from forge.training.identity import (
    ResumeVerdict,
    identity_differences,
    recorded_freeze,
    resume_verdict,
    run_identity,
)
from forge.training.run_dir import (
    RunDirBusyError,
    RunDirLock,
    foreign_records_problem,
    lock_directories,
    path_problem,
)
from forge.training.state import LoopPolicy, LoopState, PendingStep, StepResult, starting_outcome
from forge.training.step import loss_spec_of, make_pipeline_step, make_text_step, make_vlm_step
from forge.training.train_state import TrainState, parse_train_state
from forge.training.vlm import image_caption_loaders, vlm_problems


def load_and_validate_config(argv: Sequence[str]) -> RunContext:
    """Parse ``[config.toml, --overrides...]``, validate it against the data on disk.

    Raises ``ConfigError`` listing every problem; reads files but writes none.
    """
    loaded = load_config(argv)
    config = loaded.config
    world = world_info(os.environ)
    problems = [f"{k}: {m}" for k, m in parallel_problems(config, world.world_size)]
    problems += data_problems(config)
    problems += hook_problems(config.hooks)
    problems += freeze_problems(config)
    problems += vlm_problems(config)
    problems += missing_sink_packages(config)
    run = RunContext.of(config, loaded.source)
    for key, folder in run_directories(run):
        problem = path_problem(key, folder)
        if problem is not None:
            problems.append(problem)
            break  # the checkpoint directory usually lies inside the run directory
    if problems:
        raise ConfigError(problems)
    return run


def run_directories(run: RunContext) -> list[tuple[str, pathlib.Path]]:
    """The directories a run writes, with the config key that names each: the run directory
    and, when checkpointing is on or it holds checkpoints, the checkpoint directory."""
    dirs = [("run.dir", run.run_dir)]
    if run.config.checkpoint.enabled or run.checkpoint_dir.exists():
        dirs.append(("checkpoint.dir", run.checkpoint_dir))
    return dirs


def freeze_problems(config: JobConfig) -> list[str]:
    """What ``[[freeze]]`` cannot do to this model (checked on the meta device: no memory)."""
    if not config.freeze:
        return []
    with torch.device("meta"):
        names = list(named_parameters(build_model(config.model)))
    return schedule_problems(names, config.freeze)


def data_problems(config: JobConfig) -> list[str]:
    """Every data source exists and fits the model: manifests readable, ids within the vocab."""
    problems: list[str] = []
    key_of = {s.name: f"data.sources.{s.name}.path" for s in config.data.sources}
    first: Manifest | None = None
    for source in config.data.source_list:
        key = key_of.get(source.name, "data.path")
        folder = pathlib.Path(source.path)
        try:
            manifest = read_manifest(folder)
        except DataError as exc:
            problems += [f"{key}: {line}" for line in exc.lines]
            continue
        first = first or manifest
        if manifest.tokenizer != first.tokenizer:
            problems.append(
                f"{key}: {folder} was tokenized with {manifest.tokenizer}, the first source with "
                f"{first.tokenizer}; every source must use one tokenizer"
            )
        if manifest.vocab_size > config.model.vocab_size:
            problems.append(
                f"model.vocab_size: {config.model.vocab_size} is smaller than the dataset's "
                f"vocab size {manifest.vocab_size} ({folder}); token ids would fall outside "
                f"the embedding; set model.vocab_size >= {manifest.vocab_size}"
            )
        if config.data.pack_documents and "bos_id" not in manifest.tokenizer:
            problems.append(
                f"data.pack_documents: {folder}'s manifest names no bos_id to split documents "
                "at; re-prepare it with scripts/prepare_data.py"
            )
    return problems


def setup_distributed(run: RunContext) -> DistContext:
    """World info (torchrun, SLURM or one process), process group, device mesh and seeding.

    Each rank seeds its own RNG streams (``train.seed + rank``); model weights do not depend on
    them (``initial_value`` uses a generator per parameter), so every layout starts alike.
    """
    cfg = run.config
    world = world_info(os.environ)
    dims = resolve_dims(cfg.distributed, world.world_size)
    mesh = init_process_group(world, cfg.distributed, dims)
    # Weights come from per-parameter generators (see initial_value), not from these streams;
    # these serve anything sampled during training, and differ per rank.
    seed_everything(cfg.train.seed + world.rank)
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    dist = DistContext(world=world, dims=dims, mesh=mesh, device=device_for(world))
    warning = precision_warning(run.config.train.mixed_precision, dist.device.type, cpu_flags())
    if warning and dist.is_main:
        print(f"[forge] warning: {warning}", file=sys.stderr)
    return dist


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def precision_warning(precision: Precision, device: str, flags: frozenset[str]) -> str | None:
    """A warning when bf16 compute would be emulated: on a CPU without AVX-512 BF16 or AMX,
    a bf16 step ran 24x slower than fp32 (benchmarks/precision.py)."""
    if precision is not Precision.BF16 or device != "cpu" or not flags:
        return None
    if flags & {"avx512_bf16", "amx_bf16"}:
        return None
    return (
        "train.mixed_precision='bf16' on a CPU without AVX-512 BF16 / AMX is emulated and much "
        "slower than fp32; set --train.mixed_precision=fp32"
    )


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
    """
    cfg = run.config
    with torch.device("meta"):  # no memory until sharded: each rank materializes its part
        model = build_model(cfg.model)
    if cfg.train.param_dtype is Precision.BF16:  # pure bf16: allocated (and sharded) as bf16
        model.to(dtype=torch.bfloat16)
    num_params = num_parameters(model)
    pipeline = None
    pp_mesh = submesh(dist.mesh, "pp")
    if pp_mesh is not None:
        stage_index, n_stages = pp_mesh.get_local_rank(), pp_mesh.size()
        assert isinstance(model, Transformer), "a vision-language model has no pipeline stages"
        model = stage_module(model, stage_index, n_stages)
    dp_mesh = submesh(dist.mesh, "dp_replicate", "dp_shard")
    compiled = cfg.train.compile_enabled(dist.device.type, cxx_compiler_found())
    ep_mesh, experts_mesh = expert_meshes(dist.mesh, dist.dims)
    parallelize(
        model,
        tp_mesh=submesh(dist.mesh, "tp"),
        dp_mesh=dp_mesh,
        precision=cfg.train.mixed_precision,
        activation_checkpointing=cfg.train.activation_checkpointing,
        compile_blocks=compiled,
        param_dtype=cfg.train.param_dtype,
        ep_mesh=ep_mesh,
        experts_mesh=experts_mesh,
    )
    model.materialize(dist.device)
    model.init_weights(seed=cfg.train.seed)
    if cfg.freeze:  # the optimizer starts with step 1's trainable parameters only
        freeze_for_step(model, cfg.freeze, 1)
    optimizer = build_optimizer(model, cfg.optimizer)
    if pp_mesh is not None:
        assert isinstance(model, Transformer)
        group = pp_mesh.get_group()
        spec = loss_spec_of(cfg.train, compiled, cfg.model)
        stage_loss = StageLoss(cfg.model.moe, spec.moe_aux_weight, spec.moe_z_weight)
        schedule = build_schedule(
            model,
            pp_mesh.get_local_rank(),
            pp_mesh.size(),
            dist.device,
            group,
            cfg.distributed.pp_schedule,
            cfg.train.grad_accum_steps,
            stage_loss,
        )
        pipeline = PipelineContext(
            schedule, group, pp_mesh.get_local_rank(), pp_mesh.size(), stage_loss
        )
    return ModelContext(
        model=model,
        optimizer=optimizer,
        schedule=resolve_schedule(cfg.scheduler, cfg.train.max_steps),
        num_params=num_params,
        fsdp=dp_mesh is not None,
        pipeline=pipeline,
        compiled=compiled,
        freezer=Freezer(model, optimizer, cfg.freeze, cfg.optimizer),
    )


def cxx_compiler_found() -> bool:
    """Whether inductor's CPU backend has a C++ compiler (``$CXX``, else ``c++``/``g++``)."""
    names = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    return any(shutil.which(n) for n in names if n)


def setup_data(run: RunContext, dist: DistContext) -> DataContext:
    """Memory-mapped train (and eval) windows of every source and the stateful loaders."""
    cfg = run.config
    sources = cfg.data.source_list
    folders = [pathlib.Path(s.path) for s in sources]
    manifests = [read_manifest(folder) for folder in folders]
    if cfg.model.vlm is not None:
        loaders = image_caption_loaders(
            cfg,
            folders[0],
            manifests[0],
            dp_rank=dist.dp_rank,
            dp_size=dist.dp_size,
            device=dist.device,
        )
        if loaders.warning is not None:
            report_on_main(dist)(f"warning: {loaders.warning}")
        return DataContext(
            fingerprints=(dataset_fingerprint(manifests[0]),),
            manifest=manifests[0],
            train_loader=loaders.train,
            eval_loader=loaders.held_out,
        )
    seq_len, verify = cfg.train.seq_len, cfg.data.verify_checksum
    train = [
        open_windows(folder, manifest, cfg.data.train_split, seq_len, verify)
        for folder, manifest in zip(folders, manifests, strict=True)
    ]
    needed = cfg.train.batch_size * dist.dp_size
    for folder, windows in zip(folders, train, strict=True):
        if len(windows) < needed:
            raise DataError(
                f"{folder}: split '{cfg.data.train_split}' has {len(windows)} windows of "
                f"{seq_len + 1} tokens, fewer than one batch ({needed}); "
                "use more data or a smaller train.seq_len / train.batch_size"
            )
    bos_id = int(manifests[0].tokenizer["bos_id"]) if cfg.data.pack_documents else None
    loader = TextLoader(
        train,
        Sampling(
            sizes=tuple(len(w) for w in train),
            phases=resolve_phases(sources, cfg.data.phases, cfg.data.temperature),
            seed=cfg.train.effective_data_seed,
            batch_size=cfg.train.batch_size,
            rank=dist.dp_rank,
            world_size=dist.dp_size,
            grad_accum_steps=cfg.train.grad_accum_steps,
            max_epochs=cfg.train.max_epochs,
        ),
        bos_id=bos_id,
        num_workers=cfg.data.num_workers,
        device=dist.device,
    )
    eval_loader = None
    if cfg.eval.interval > 0:
        held_out = open_windows(folders[0], manifests[0], cfg.data.eval_split, seq_len, verify)
        if len(held_out) < needed:
            raise DataError(
                f"{folders[0]}: split '{cfg.data.eval_split}' has {len(held_out)} windows of "
                f"{seq_len + 1} tokens, fewer than one eval batch ({needed}); set "
                "--eval.interval=0, or re-prepare the data with a larger --validation-percent"
            )
        eval_loader = TextLoader(
            [held_out],
            single_source(
                len(held_out),
                cfg.train.batch_size,
                seed=0,
                rank=dist.dp_rank,
                world_size=dist.dp_size,
            ),
            bos_id=bos_id,
            device=dist.device,
        )
    names = tuple(s.name for s in sources)
    return DataContext(
        fingerprints=tuple(dataset_fingerprint(m) for m in manifests),
        manifest=manifests[0],
        train_loader=loader,
        eval_loader=eval_loader,
        # per-source metrics need the per-row loss: the text step has it, pipeline stages not
        source_stats=SourceStats(names, dist.device)
        if len(names) > 1 and cfg.distributed.pp == 1
        else None,
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


class RunMismatchError(ConfigError):
    """Resuming a checkpoint written by another model or another data order."""


def setup_checkpointing(
    run: RunContext, dist: DistContext, model: ModelContext, data: DataContext
) -> CheckpointContext:
    """Resolve where the run starts and restore that state into the model, optimizer and loader.

    Each candidate checkpoint is checked whole (files, train state, the run identity) before
    any tensor is loaded; a damaged one gives way to the next older one.
    """
    cfg = run.config.checkpoint
    load_path = pathlib.Path(cfg.load_path) if cfg.load_path else None
    plan = resolve_resume(run.checkpoint_dir, load_path)
    say = report_on_main(dist)
    for path in plan.skipped:
        say(f"skipping incomplete checkpoint {path}")
    state = LoopState()
    if plan.source is ResumeSource.CHECKPOINT_DIR and plan.path is not None:
        identity = run_identity(run.config, dist.dp_size, data.fingerprints)

        def load(path: pathlib.Path) -> TrainState:
            check_loadable(path, model.model)
            train_state = parse_train_state(read_train_state(path), path)
            check_same_run(train_state, identity, path, cfg.allow_config_change, say)
            if model.freezer is not None:  # the optimizer as in the last step run
                hold_checkpoint_stage(model.freezer, train_state, run.config.freeze)
            load_checkpoint(path, model.model, model.optimizer, rank=dist.rank)
            return train_state

        path, train_state = first_loadable((plan.path, *plan.fallbacks), load, say)
        state = train_state.loop_state
        data.train_loader.load_state_dict(CONVERTER.unstructure(train_state.loader))
        say(f"resumed from {path} at step {state.step}")
    else:
        problem = foreign_records_problem(run.run_dir, run.checkpoint_dir, run.config)
        if problem is not None:
            raise RunMismatchError(problem)
    if plan.source is ResumeSource.LOAD_PATH and plan.path is not None:
        optimizer = model.optimizer if cfg.load_optimizer else None
        load_checkpoint(plan.path, model.model, optimizer, rank=dist.rank, restore_rng_state=False)
        recorded = read_train_state(plan.path).get("identity")
        differences = identity_differences(
            recorded if isinstance(recorded, dict) else {},
            run_identity(run.config, dist.dp_size, data.fingerprints),
        )
        say(f"initial weights from {plan.path}")
        for difference in differences:
            say(f"  differs from the run that wrote it: {difference.describe()}")
    return CheckpointContext(plan=plan, initial_state=state)


def hold_checkpoint_stage(
    freezer: Freezer, train_state: TrainState, rules: Sequence[FreezeRule]
) -> None:
    """Put the optimizer in the stage of the checkpoint's last step, under the freeze
    schedule that run recorded (``rules`` when it predates them), so its state loads; the
    current schedule takes over at the next step."""
    recorded = recorded_freeze(train_state.identity or {})
    last = max(1, train_state.step)
    schedule = recorded if recorded is not None else rules
    freezer.hold(trainable_names(freezer.params, schedule, last), last)


def report_on_main(dist: DistContext) -> Callable[[str], None]:
    """A ``[forge]`` line on stderr from rank 0; nothing elsewhere."""

    def say(line: str) -> None:
        if dist.is_main:
            print(f"[forge] {line}", file=sys.stderr)

    return say


def check_same_run(
    train_state: TrainState,
    identity: dict,
    path: pathlib.Path,
    allow_change: bool,
    say: Callable[[str], None],
) -> None:
    """Refuse (or, with ``checkpoint.allow_config_change``, warn about) a resume whose model or
    data order differs from what the checkpoint recorded."""
    differences = identity_differences(train_state.identity or {}, identity)
    verdict = resume_verdict(differences, allow_change)
    if verdict is ResumeVerdict.REFUSE:
        kinds = " and ".join(sorted({d.kind.value for d in differences}))
        raise RunMismatchError(
            f"{path}: written with a different {kinds}: "
            f"{'; '.join(d.describe() for d in differences)}; resume with the checkpoint's "
            "values, or set checkpoint.allow_config_change=true to continue anyway"
        )
    for d in differences if verdict is ResumeVerdict.WARN else ():
        say(f"warning: resuming {path} with a different {d.kind.value}: {d.describe()}")


def prepare_run_dir(run: RunContext, dist: DistContext, ckpt: CheckpointContext) -> None:
    """Write the resolved ``config.toml`` and align ``metrics.jsonl`` with the resumed step
    (records past it came from a run that crashed after its checkpoint). A run that is
    already complete changes nothing on disk."""
    if not dist.is_main:
        return
    if starting_outcome(ckpt.initial_state, loop_policy(run.config)) is not None:
        return
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "config.toml").write_text(dumps_toml(unstructure_config(run.config)))
    trim_records_after(run.metrics_path, ckpt.initial_state.step)
    remove_stale_temporaries(run.checkpoint_dir)


def make_step_fn(
    run: RunContext,
    dist: DistContext,
    model: ModelContext,
    data: DataContext | None = None,
    hooks: Hooks | None = None,
) -> Callable[[tuple[Batch, ...], LoopState], StepResult]:
    """The step function the config selects: the vision-language step under ``model.vlm``,
    the pipeline step under ``distributed.pp > 1``, else the text LM step;
    ``hooks.on_before_optimizer_step`` runs inside it, and with ``[[freeze]]`` the
    schedule's transitions run before it."""
    before_update: Callable[[PendingStep], None] | None = None
    if hooks is not None:
        before_update = functools.partial(call_before_update, hooks, model.model, model.optimizer)

    step = configured_step(run, dist, model, data, before_update)
    if model.freezer is None:
        return step
    return functools.partial(freezing_step, step, model.freezer)


def freezing_step(
    step: Callable[[tuple[Batch, ...], LoopState], StepResult],
    freezer: Freezer,
    batches: tuple[Batch, ...],
    state: LoopState,
) -> StepResult:
    """``step`` after the freeze schedule's transition for it, if any (reported in the
    result, as is the first step's trainable set)."""
    transition = freezer.apply(state.step + 1)
    if transition is None and state.step == 0 and freezer.rules:
        transition = freezer.counts(1)
    result = step(batches, state)
    return result if transition is None else attrs.evolve(result, freeze=transition)


def configured_step(
    run: RunContext,
    dist: DistContext,
    model: ModelContext,
    data: DataContext | None,
    before_update: Callable[[PendingStep], None] | None,
) -> Callable[[tuple[Batch, ...], LoopState], StepResult]:
    """The vision-language step (``model.vlm``), the pipeline step (``distributed.pp >
    1``), else the text LM step."""
    cfg = run.config
    loss_spec = loss_spec_of(cfg.train, model.compiled, cfg.model)
    balance_rate = cfg.model.moe_bias_update_rate if cfg.model.moe else 0.0
    essentials = (
        model.model,
        model.optimizer,
        model.schedule,
        cfg.optimizer.lr,
        cfg.train.mixed_precision,
        cfg.train.grad_clip_norm,
    )
    options = {
        "fsdp_mixed_precision": model.fsdp,
        "dp_size": dist.dp_size,
        "loss_scale": NanInjector(faults_from_env(os.environ), dist.rank),
        "loss_spec": loss_spec,
        "before_update": before_update,
    }
    if cfg.model.vlm is not None:
        return make_vlm_step(*essentials, arch=cfg.model.vlm, **options)
    if model.pipeline is not None:
        return make_pipeline_step(
            model.model,
            model.optimizer,
            model.pipeline,
            model.schedule,
            cfg.optimizer.lr,
            cfg.train.grad_clip_norm,
            dp_size=dist.dp_size,
            loss_spec=loss_spec,
            before_update=before_update,
            moe_shape=moe_stats_shape(cfg.model),
            balance_rate=balance_rate,
            world_size=dist.world_size,
        )
    return make_text_step(
        *essentials,
        **options,
        stats=data.source_stats if data is not None else None,
        balance_rate=balance_rate,
        world_size=dist.world_size,
    )


def moe_stats_shape(cfg: ModelConfig) -> tuple[int, int] | None:
    """The shape of a mixture-of-experts model's statistics (None when dense)."""
    return (len(cfg.moe_layers), stats_width(cfg.moe_num_experts)) if cfg.moe else None


def call_before_update(
    hooks: Hooks, model: nn.Module, optimizer: torch.optim.Optimizer, pending: PendingStep
) -> None:
    """``hooks.on_before_optimizer_step`` in the step function's shape."""
    hooks.on_before_optimizer_step(pending, model, optimizer)


def train_batches(run: RunContext, data: DataContext) -> StepBatches:
    """The loader grouped into optimizer steps of ``grad_accum_steps`` micro-batches."""
    return step_batches(data.train_loader, run.config.train.grad_accum_steps)


def loop_policy(config: JobConfig) -> LoopPolicy:
    """The loop's fixed parameters from the config."""
    ck = config.checkpoint
    schedule = None
    if ck.enabled:
        window = ck.dyn_ckpt_window
        schedule = SaveSchedule(
            interval=ck.interval,
            window_start=window.start if window else None,
            window_stop=window.stop if window else None,
        )
    return LoopPolicy(
        max_steps=config.train.max_steps,
        log_interval=config.metrics.log_interval,
        eval_interval=config.eval.interval,
        schedule=schedule,
        nonfinite_limit=config.nonfinite_limit,
        nonfinite_policy=config.resilience.on_nonfinite,
        snapshot_interval=config.resilience.snapshot_interval,
    )


def config_fingerprint(config: JobConfig) -> str:
    """A short hash of the model section: a resume under a different architecture is caught."""
    text = json.dumps(CONVERTER.unstructure(config.model), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
