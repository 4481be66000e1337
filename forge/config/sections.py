"""Config sections: one frozen attrs class per TOML table, with documented defaults.

Each section's ``problems()`` returns every out-of-range value as ``(key, message)`` pairs, so
that the loader can report all of them at once instead of stopping at the first.
"""

from __future__ import annotations

import enum

import attrs

Problem = tuple[str, str]


class Precision(enum.Enum):
    """Compute dtype of the forward and backward pass (parameters stay fp32)."""

    BF16 = "bf16"
    FP32 = "fp32"


class OptimizerName(enum.Enum):
    ADAMW = "adamw"


class ScheduleName(enum.Enum):
    """LR schedule shapes; each has a linear warmup in front."""

    COSINE = "cosine"
    LINEAR = "linear"
    WSD = "wsd"
    CONSTANT = "constant"
    NONE = "none"


class AsyncMode(enum.Enum):
    DISABLED = "disabled"  # the loop waits for every save
    ASYNC = "async"  # stage (copy) the state, write it in a background thread
    ASYNC_PROCESS = "async_process"  # stage into shared memory, write in a checkpoint process


class ExportDtype(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class PipelineSchedule(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class ActivationCheckpointing(enum.Enum):
    NONE = "none"
    FULL = "full"  # every block recomputes its activations in backward
    SELECTIVE = "selective"  # every second block


class NonFinitePolicy(enum.Enum):
    """What the loop does with a step whose loss or grad norm is not finite."""

    SKIP = "skip"  # drop the update and go on
    ROLLBACK = "rollback"  # restore the last in-memory snapshot, skip the failing batches
    ABORT = "abort"  # end the run at the first


def _positive(problems: list[Problem], key: str, value: float) -> None:
    if value <= 0:
        problems.append((key, f"must be > 0, got {value}"))


def _non_negative(problems: list[Problem], key: str, value: float) -> None:
    if value < 0:
        problems.append((key, f"must be >= 0, got {value}"))


def _not_empty(problems: list[Problem], key: str, value: str | None) -> None:
    """An optional path: unset is fine, an empty string names nothing."""
    if value is not None and not value.strip():
        problems.append((key, "must not be empty; leave it out for the default"))


@attrs.frozen
class RunConfig:
    """Where a run lives. ``dir`` defaults to ``runs/<config file stem>``."""

    dir: str | None = None

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        _not_empty(p, "run.dir", self.dir)
        return p


@attrs.frozen
class ModelConfig:
    """A Llama-style decoder. ``n_kv_heads`` < ``n_heads`` gives grouped-query attention."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    vocab_size: int = 259
    ffn_hidden_dim: int | None = None  # None: 8/3 * dim rounded up to `multiple_of`
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        raw = int(8 * self.dim / 3)
        return self.multiple_of * -(-raw // self.multiple_of)

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            _positive(p, f"model.{key}", getattr(self, key))
        _positive(p, "model.norm_eps", self.norm_eps)
        _positive(p, "model.rope_theta", self.rope_theta)
        _positive(p, "model.init_std", self.init_std)
        if self.n_kv_heads is not None:
            _positive(p, "model.n_kv_heads", self.n_kv_heads)
        if self.ffn_hidden_dim is not None:
            _positive(p, "model.ffn_hidden_dim", self.ffn_hidden_dim)
        if self.n_heads > 0 and self.dim % self.n_heads:
            p.append(("model.dim", f"must be divisible by model.n_heads={self.n_heads}"))
        elif self.n_heads > 0 and (self.dim // self.n_heads) % 2:
            p.append(("model.dim", "dim / n_heads (the head size) must be even for RoPE"))
        if self.n_heads > 0 and self.kv_heads > 0 and self.n_heads % self.kv_heads:
            p.append(("model.n_kv_heads", f"must divide model.n_heads={self.n_heads}"))
        return p


@attrs.frozen
class TrainConfig:
    """The optimisation loop. ``batch_size`` is per micro-batch; a step is
    ``grad_accum_steps`` micro-batches."""

    batch_size: int = 8
    seq_len: int = 256
    max_steps: int = 1000
    max_epochs: int | None = None  # None: unbounded; else the loop ends DATA_EXHAUSTED
    grad_accum_steps: int = 1
    grad_clip_norm: float | None = 1.0  # None: no clipping (the norm is still measured)
    seed: int = 42
    data_seed: int | None = None  # None: same as seed
    mixed_precision: Precision = Precision.BF16
    num_threads: int = 0  # 0: torch's default
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    compile: bool = False  # torch.compile each block

    @property
    def effective_data_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for key in ("batch_size", "seq_len", "max_steps", "grad_accum_steps"):
            _positive(p, f"train.{key}", getattr(self, key))
        if self.max_epochs is not None:
            _positive(p, "train.max_epochs", self.max_epochs)
        if self.grad_clip_norm is not None:
            _positive(p, "train.grad_clip_norm", self.grad_clip_norm)
        _non_negative(p, "train.seed", self.seed)
        _non_negative(p, "train.num_threads", self.num_threads)
        return p


@attrs.frozen
class OptimizerConfig:
    """AdamW with explicit param groups: norms and biases never decay; embeddings by switch."""

    name: OptimizerName = OptimizerName.ADAMW
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_embeddings: bool = False

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        _positive(p, "optimizer.lr", self.lr)
        _non_negative(p, "optimizer.weight_decay", self.weight_decay)
        _positive(p, "optimizer.eps", self.eps)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            p.append(("optimizer.betas", f"each beta must be in [0, 1), got {list(self.betas)}"))
        return p


@attrs.frozen
class SchedulerConfig:
    """LR schedule as a pure function of the step. ``decay_steps`` is the length of the decay
    (cosine, linear: from the end of warmup; wsd: the final tail). None: up to max_steps."""

    name: ScheduleName = ScheduleName.COSINE
    warmup_steps: int = 100
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        _non_negative(p, "scheduler.warmup_steps", self.warmup_steps)
        if self.decay_steps is not None:
            _positive(p, "scheduler.decay_steps", self.decay_steps)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            p.append(("scheduler.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}"))
        return p


@attrs.frozen
class DataSource:
    """One tokenized corpus in a mixture: a folder made by ``scripts/prepare_data.py``."""

    name: str
    path: str
    weight: float = 1.0


@attrs.frozen
class DataPhase:
    """From step ``start_step`` on (as logged, 1-based): new source weights (by name; sources not
    named keep their base weight) and a multiplier on the scheduled LR."""

    start_step: int
    weights: dict[str, float] = attrs.field(factory=dict)
    lr_scale: float = 1.0


@attrs.frozen
class DataConfig:
    """Token shards prepared by ``scripts/prepare_data.py`` (folders with ``manifest.json``).

    One source: ``path``. A mixture: ``[[data.sources]]`` (``path`` is then unused), sampled with
    probabilities proportional to ``weight ** (1 / temperature)``. ``[[data.phases]]`` change the
    weights and scale the LR from a given step (with one source, only the LR scale applies).
    """

    path: str = "data/stdlib"
    train_split: str = "train"
    eval_split: str = "validation"
    verify_checksum: bool = True
    sources: tuple[DataSource, ...] = ()
    temperature: float = 1.0
    phases: tuple[DataPhase, ...] = ()
    pack_documents: bool = False  # block-diagonal attention, positions restart per document
    num_workers: int = 0  # loader worker processes (0: read in the training process)

    @property
    def source_list(self) -> tuple[DataSource, ...]:
        """The sources to sample: ``sources``, or ``path`` alone."""
        return self.sources or (DataSource(name="default", path=self.path),)

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        if not self.sources and not self.path:
            p.append(("data.path", "must name a folder made by scripts/prepare_data.py"))
        names = [s.name for s in self.sources]
        for i, source in enumerate(self.sources):
            key = f"data.sources[{i}]"
            if not source.name:
                p.append((f"{key}.name", "must not be empty"))
            elif source.name in names[:i]:
                p.append((f"{key}.name", f"'{source.name}' is already the name of a source"))
            if not source.path:
                p.append((f"{key}.path", "must name a folder made by scripts/prepare_data.py"))
            _non_negative(p, f"{key}.weight", source.weight)
        if self.sources and sum(s.weight for s in self.sources) <= 0:
            p.append(("data.sources", "at least one source needs a weight > 0"))
        _positive(p, "data.temperature", self.temperature)
        _non_negative(p, "data.num_workers", self.num_workers)
        known = [s.name for s in self.source_list]
        previous = 0
        for i, phase in enumerate(self.phases):
            key = f"data.phases[{i}]"
            if phase.start_step <= previous:
                p.append(
                    (f"{key}.start_step", f"must be > {previous} (phases in step order), "
                     f"got {phase.start_step}")
                )  # fmt: skip
            previous = max(previous, phase.start_step)
            _positive(p, f"{key}.lr_scale", phase.lr_scale)
            for name, weight in phase.weights.items():
                if name not in known:
                    p.append((f"{key}.weights.{name}", f"no such source (sources: {known})"))
                _non_negative(p, f"{key}.weights.{name}", weight)
            if sum(phase.weights.get(s.name, s.weight) for s in self.source_list) <= 0:
                p.append((f"{key}.weights", "at least one source needs a weight > 0"))
        return p


@attrs.frozen
class EvalConfig:
    """Held-out loss every ``interval`` steps over ``steps`` batches (interval 0: off)."""

    interval: int = 0
    steps: int = 20

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        _non_negative(p, "eval.interval", self.interval)
        _positive(p, "eval.steps", self.steps)
        return p


@attrs.frozen
class DynamicWindow:
    """Power-of-two milestones: inside [start, stop] save at start, start+1, start+2, start+4..."""

    start: int = 0
    stop: int = 512

    def problems(self, prefix: str) -> list[Problem]:
        p: list[Problem] = []
        _non_negative(p, f"{prefix}.start", self.start)
        if self.stop < self.start:
            p.append((f"{prefix}.stop", f"must be >= start={self.start}, got {self.stop}"))
        return p


@attrs.frozen
class CheckpointConfig:
    """DCP checkpoints. ``dir`` defaults to ``<run.dir>/checkpoints``; ``keep_last_n`` <= 0 keeps
    all. ``load_path`` is used as initial weights only when ``dir`` holds no checkpoint."""

    enabled: bool = True
    dir: str | None = None
    interval: int = 1000
    async_mode: AsyncMode = AsyncMode.DISABLED
    dyn_ckpt_window: DynamicWindow | None = None
    keep_last_n: int = 3
    load_path: str | None = None
    load_optimizer: bool = False  # with load_path: also take its optimizer state
    # resume even if the model or data order differs from the checkpoint's (with a warning)
    allow_config_change: bool = False
    export_final: bool = False  # the final save also writes <run.dir>/export (safetensors)
    export_dtype: ExportDtype = ExportDtype.BFLOAT16

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        _not_empty(p, "checkpoint.dir", self.dir)
        _not_empty(p, "checkpoint.load_path", self.load_path)
        _positive(p, "checkpoint.interval", self.interval)
        if self.dyn_ckpt_window is not None:
            p += self.dyn_ckpt_window.problems("checkpoint.dyn_ckpt_window")
        return p


@attrs.frozen
class MetricsConfig:
    """Step metrics to stdout and ``<run.dir>/metrics.jsonl`` every ``log_interval`` steps."""

    log_interval: int = 10
    jsonl: bool = True

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        _positive(p, "metrics.log_interval", self.log_interval)
        return p


@attrs.frozen
class ResilienceConfig:
    """Non-finite steps, preemption and health.

    ``on_nonfinite``: ``skip`` drops the update, ``rollback`` restores the in-memory snapshot
    taken every ``snapshot_interval`` steps, ``abort`` ends the run at the first; after
    ``max_consecutive_nonfinite`` in a row the run ends NAN_ABORT. ``health_timeout_s`` bounds
    the per-step control-word exchange and the liveness check run every
    ``health_check_interval`` steps (0: off). ``shutdown_timeout_s``: after a preemption
    signal, the process exits anyway if the emergency save has not finished by then.
    """

    on_nonfinite: NonFinitePolicy = NonFinitePolicy.SKIP
    max_consecutive_nonfinite: int = 3
    snapshot_interval: int = 50
    health_check_interval: int = 100
    health_timeout_s: float = 300.0
    shutdown_timeout_s: float = 600.0

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        _positive(p, "resilience.max_consecutive_nonfinite", self.max_consecutive_nonfinite)
        _positive(p, "resilience.snapshot_interval", self.snapshot_interval)
        _non_negative(p, "resilience.health_check_interval", self.health_check_interval)
        _positive(p, "resilience.health_timeout_s", self.health_timeout_s)
        _positive(p, "resilience.shutdown_timeout_s", self.shutdown_timeout_s)
        return p


@attrs.frozen
class DistributedConfig:
    """How the world is split. Dims of size 1 are dropped from the mesh; ``dp_shard = -1``
    takes whatever the other dims leave of the world size."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    backend: str = "cpu:gloo,cuda:nccl"
    timeout_s: float = 600.0  # process-group init and every collective

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for key in ("dp_replicate", "tp", "pp"):
            _positive(p, f"distributed.{key}", getattr(self, key))
        if self.dp_shard != -1 and self.dp_shard < 1:
            p.append(
                ("distributed.dp_shard", f"must be -1 (the rest) or >= 1, got {self.dp_shard}")
            )
        _positive(p, "distributed.timeout_s", self.timeout_s)
        return p


@attrs.frozen
class JobConfig:
    """The whole run configuration: one attribute per TOML table."""

    run: RunConfig = attrs.Factory(RunConfig)
    model: ModelConfig = attrs.Factory(ModelConfig)
    train: TrainConfig = attrs.Factory(TrainConfig)
    optimizer: OptimizerConfig = attrs.Factory(OptimizerConfig)
    scheduler: SchedulerConfig = attrs.Factory(SchedulerConfig)
    data: DataConfig = attrs.Factory(DataConfig)
    eval: EvalConfig = attrs.Factory(EvalConfig)
    checkpoint: CheckpointConfig = attrs.Factory(CheckpointConfig)
    metrics: MetricsConfig = attrs.Factory(MetricsConfig)
    resilience: ResilienceConfig = attrs.Factory(ResilienceConfig)
    distributed: DistributedConfig = attrs.Factory(DistributedConfig)

    @property
    def nonfinite_limit(self) -> int:
        """Consecutive non-finite steps that end the run."""
        if self.resilience.on_nonfinite is NonFinitePolicy.ABORT:
            return 1
        return self.resilience.max_consecutive_nonfinite
