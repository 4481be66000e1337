"""``[train]``: the optimisation loop, its precision, activation checkpointing and compile."""

from __future__ import annotations

import enum
import math

import attrs

from forge.config.ranges import Problem, non_negative, positive
from forge.types import Float8Drift


class Precision(enum.Enum):
    """A dtype: of the compute (``train.mixed_precision``) or of the parameters, gradients and
    optimizer state (``train.param_dtype``)."""

    BF16 = "bf16"
    FP32 = "fp32"


# the overrides that resume a run without FP8 (after the drift guard stopped it, or fell back):
# the guard's keys have no effect without FP8, and a key with no effect is refused
FLOAT8_OFF = (
    "--train.float8=off --train.float8_check=0 --train.float8_on_drift=warn (and the "
    "float8_check tolerances removed, where set)"
)


class Float8Recipe(enum.Enum):
    """``train.float8``: FP8 matrix products through torchao (``forge.parallel.float8``), and
    how their scales are taken: one per tensor, or one per row."""

    OFF = "off"
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


class ActivationCheckpointing(enum.Enum):
    NONE = "none"
    FULL = "full"  # every block recomputes its activations in backward
    SELECTIVE = "selective"  # every second block


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
    mixed_precision: Precision = Precision.BF16  # compute dtype of forward and backward
    # parameters, gradients and optimizer state: fp32 master weights, or pure bf16 (a numerics
    # trade-off: KempnerForge's bf16 mode)
    param_dtype: Precision = Precision.FP32
    num_threads: int = 0  # 0: torch's default
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    # torch.compile each block and each loss chunk; None: on where it was measured to pay off
    # (bf16 compute: 1.24-1.28x on the debug shapes) and a compiler is at hand, else off
    compile: bool | None = None
    z_loss_weight: float = 0.0  # adds weight × mean(logsumexp²) to the loss (0: off)
    # tokens per chunk of the output projection + cross-entropy: the fp32 logits of one chunk
    # exist at a time, never those of the whole micro-batch (0: the plain, unchunked loss)
    loss_chunk_size: int = 256
    # multi-token prediction (model.mtp_depth > 0): the depths' mean loss × this joins the
    # objective (DeepSeek-V3: 0.3, then 0.1); the logged ``loss`` stays the main model's
    mtp_loss_weight: float = 0.3
    # FP8 matrix products for the linear layers (docs/precision.md#fp8; the extra "fp8")
    float8: Float8Recipe = Float8Recipe.OFF
    # every this many steps, the step is also computed in high precision and compared
    # (docs/precision.md#the-drift-guard); 0: never
    float8_check: int = 0
    # the relative differences of the loss, and of the gradient norm, past which FP8 has
    # drifted (a clean run's, measured over 200 steps: 0.5% and 19%; docs/precision.md)
    float8_check_tolerance: float = 0.05
    float8_check_grad_tolerance: float = 0.5
    float8_on_drift: Float8Drift = Float8Drift.WARN
    # deterministic kernels everywhere (docs/precision.md#deterministic-mode): two launches
    # of one config give the same bits on a GPU too
    deterministic: bool = False

    def compile_enabled(self, device_type: str, compiler_found: bool) -> bool:
        """Whether blocks and loss chunks are compiled: ``compile`` when set; by default only
        for bf16 compute, on CUDA or on a CPU with a C++ compiler (inductor needs one)."""
        if self.compile is not None:
            return self.compile
        return self.mixed_precision is Precision.BF16 and (device_type == "cuda" or compiler_found)

    @property
    def effective_data_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def float8_problems(self) -> list[Problem]:
        """The drift guard: a check interval >= 0, only with FP8 on, and a finite tolerance."""
        p: list[Problem] = []
        non_negative(p, "train.float8_check", self.float8_check)
        for key in ("float8_check_tolerance", "float8_check_grad_tolerance"):
            tolerance = getattr(self, key)
            if not math.isfinite(tolerance) or tolerance <= 0:
                p.append((f"train.{key}", f"must be a finite number > 0, got {tolerance}"))
        defaults = TrainConfig()
        for key in ("float8_check_tolerance", "float8_check_grad_tolerance", "float8_on_drift"):
            if getattr(self, key) == getattr(defaults, key):
                continue
            if self.float8 is Float8Recipe.OFF:
                p.append((f"train.{key}", "has no effect with train.float8 = 'off'; remove it"))
            elif self.float8_check == 0:  # a drift policy no step is checked against
                p.append(
                    (
                        f"train.{key}",
                        "has no effect with train.float8_check = 0 (no step is compared with "
                        "high precision); set float8_check to the steps between checks, or "
                        "remove it",
                    )
                )
        if self.float8_check > 0 and self.float8 is Float8Recipe.OFF:
            p.append(
                (
                    "train.float8_check",
                    "compares FP8 steps with high precision: it needs train.float8 = "
                    "'tensorwise' or 'rowwise'; set it to 0",
                )
            )
        return p

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for key in ("batch_size", "seq_len", "max_steps", "grad_accum_steps"):
            positive(p, f"train.{key}", getattr(self, key))
        if self.max_epochs is not None:
            positive(p, "train.max_epochs", self.max_epochs)
        if self.grad_clip_norm is not None:
            positive(p, "train.grad_clip_norm", self.grad_clip_norm)
        non_negative(p, "train.seed", self.seed)
        if self.data_seed is not None:  # the data order's generator takes no negative seed
            non_negative(p, "train.data_seed", self.data_seed)
        non_negative(p, "train.num_threads", self.num_threads)
        non_negative(p, "train.z_loss_weight", self.z_loss_weight)
        non_negative(p, "train.loss_chunk_size", self.loss_chunk_size)
        p += self.float8_problems()
        if not math.isfinite(self.mtp_loss_weight) or self.mtp_loss_weight < 0:
            p.append(
                (
                    "train.mtp_loss_weight",
                    f"must be a finite number >= 0, got {self.mtp_loss_weight}",
                )
            )
        if self.param_dtype is Precision.BF16 and self.mixed_precision is not Precision.BF16:
            p.append(
                (
                    "train.param_dtype",
                    "'bf16' parameters compute in bf16; set train.mixed_precision='bf16' too",
                )
            )
        return p
