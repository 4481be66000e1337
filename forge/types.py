"""The vocabulary every floor shares: what a step reports, what the loop carries, how a run
ends and its exit codes, and the hooks' interface. No torch and nothing else from forge here,
so that ``optim/``, ``metrics/`` and ``resilience/`` speak the loop's language without
importing ``training/``."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:  # types of the hooks' arguments only: this module never needs torch
    import pathlib

    import torch
    from torch import nn


class LoopOutcome(enum.Enum):
    """The closed set of ways ``run_training_loop`` can end."""

    COMPLETED = "completed"  # reached train.max_steps
    ALREADY_COMPLETE = "already_complete"  # resumed at or past max_steps: zero iterations
    DATA_EXHAUSTED = "data_exhausted"  # train.max_epochs consumed before max_steps
    NAN_ABORT = "nan_abort"  # too many consecutive non-finite steps
    HEALTH_FAILURE = "health_failure"  # a rank failed the health check
    SHUTDOWN = "shutdown"  # a preemption signal; an emergency checkpoint was saved
    REPLAY_MISMATCH = "replay_mismatch"  # a replayed step came out three ways on some rank
    FLOAT8_DRIFT = "float8_drift"  # an FP8 step drifted from its high-precision recomputation


class ExitCode(enum.IntEnum):
    """Every process exit code ``scripts/train.py`` documents; the one definition that
    ``outcome.exit_code``, the signal handlers and ``--help`` read."""

    OK = 0  # completed, already complete, or the data ran out
    CONFIG_ERROR = 2  # bad config, data or checkpoint: nothing was trained
    NAN_ABORT = 3  # too many consecutive non-finite steps
    HEALTH_FAILURE = 4  # a rank stalled or died
    SAVE_FAILED = 5  # a final or emergency save (or the last step's) could not be written,
    # or a save was given up on while its write ran (its store stopped answering)
    REPLAY_MISMATCH = 6  # a rank computes inconsistently: suspect its hardware
    FLOAT8_DRIFT = 7  # FP8 drifted from high precision (train.float8_on_drift = "stop")
    SHUTDOWN = 75  # EX_TEMPFAIL: preempted, "try again later" (requeue and resume)
    INTERRUPTED = 130  # a second Ctrl-C: the save in progress was abandoned (one in set-up)


@attrs.frozen
class LossStats:
    """The running statistics a spike is measured against: the steps taken into them, and
    the exponentially weighted mean and variance of their loss (``forge.training.loop.plan``)."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0


@attrs.frozen
class LoopState:
    """Everything the loop carries from one step to the next."""

    step: int = 0  # optimizer steps taken so far (the next step to run has this index)
    tokens_seen: int = 0
    nonfinite_streak: int = 0  # consecutive steps whose update was dropped (non-finite, spike)
    # the latest dropped step not yet passed by an applied one: after a rollback the steps
    # up to it recur, and the streak clears once it is applied (a step that always fails aborts)
    failed_at: int | None = None
    last_saved_step: int | None = None
    last_step_finite: bool = True  # the last step's update was applied
    skipped_ranges: tuple[tuple[int, int], ...] = ()  # (first, last) steps rolled back over
    loss_stats: LossStats = attrs.Factory(LossStats)  # resilience.spike_threshold's reference
    spikes: int = 0  # steps whose loss was a spike, since the run began
    nonfinite_steps: int = 0  # steps not finite on some rank (update dropped), since it began
    replay_mismatches: int = 0  # replayed steps whose computations disagreed, since it began
    # the step whose FP8 drift switched the run to high precision (float8_on_drift = "fallback"):
    # a resume computes in high precision too, as the run never interrupted does
    float8_fallback_step: int | None = None


@attrs.frozen
class MoeStepStats:
    """A mixture-of-experts model's step, on this rank: the mean balancing and router
    z-losses per MoE layer, the assignments dropped by capacity and all assignments made, and
    the tokens routed to each expert, one tuple per MoE layer."""

    aux_loss: float
    z_loss: float
    dropped: float
    assigned: float
    loads: tuple[tuple[float, ...], ...]

    @property
    def finite(self) -> bool:
        return math.isfinite(self.aux_loss) and math.isfinite(self.z_loss)

    def flat(self) -> list[float]:
        """aux, z, dropped, assigned, then every layer's loads (``stats_from_flat``'s input)."""
        flat = [self.aux_loss, self.z_loss, self.dropped, self.assigned]
        for layer in self.loads:
            flat += layer
        return flat


def stats_from_flat(values: Sequence[float], n_layers: int, n_experts: int) -> MoeStepStats:
    """The ``MoeStepStats`` whose ``flat()`` is ``values``."""
    loads = tuple(
        tuple(values[4 + i * n_experts : 4 + (i + 1) * n_experts]) for i in range(n_layers)
    )
    return MoeStepStats(values[0], values[1], values[2], values[3], loads)


@attrs.frozen
class SourceTotals:
    """A data mixture's step on this rank: each source's summed per-token loss and its
    number of label tokens, in source order."""

    loss: tuple[float, ...]
    tokens: tuple[float, ...]

    def __add__(self, other: SourceTotals) -> SourceTotals:
        return SourceTotals(
            tuple(a + b for a, b in zip(self.loss, other.loss, strict=True)),
            tuple(a + b for a, b in zip(self.tokens, other.tokens, strict=True)),
        )

    def flat(self) -> list[float]:
        """Every source's loss, then every source's tokens (``from_flat``'s input)."""
        return [*self.loss, *self.tokens]

    @classmethod
    def from_flat(cls, values: Sequence[float]) -> SourceTotals:
        """The totals whose ``flat()`` is ``values``."""
        n = len(values) // 2
        return cls(tuple(values[:n]), tuple(values[n:]))


@attrs.frozen
class FreezeTransition:
    """The freeze schedule changed the trainable set at the start of ``step``: the parameter
    elements that train from then on, and those that stay frozen."""

    step: int
    trainable: int
    frozen: int


@attrs.frozen
class ReplayVerdict:
    """A replayed step, agreed by every rank: the ranks whose first two computations
    disagreed, those whose third agreed with neither (no majority), and those whose
    replicated gradients differ from their replicas'. Either of the last two: the step is not
    applied and the run ends REPLAY_MISMATCH."""

    mismatched: tuple[int, ...] = ()
    inconsistent: tuple[int, ...] = ()
    diverged: tuple[int, ...] = ()
    # false: an operation without a deterministic kernel (these, on this rank) ran, and replays
    # stopped for the launch; nothing was compared
    compared: bool = True
    unverifiable: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        """Whether the step may not be applied: no majority, or diverged replicas."""
        return bool(self.inconsistent or self.diverged)


class Float8Drift(enum.Enum):
    """``train.float8_on_drift``: what the run does when an FP8 step drifts from its
    high-precision recomputation past ``train.float8_check_tolerance``."""

    WARN = "warn"  # say so, record it, train on
    FALLBACK = "fallback"  # apply this step and compute in high precision from the next on
    STOP = "stop"  # apply nothing and end the run FLOAT8_DRIFT (exit 7)


@attrs.frozen
class Float8Verdict:
    """A step computed twice, in FP8 and in high precision (``train.float8_check``), agreed
    by every rank: the relative differences of its loss and gradient norm, and what the run
    does about them (``action``: None when within their tolerances)."""

    loss_drift: float
    grad_norm_drift: float
    action: Float8Drift | None = None

    @property
    def stops(self) -> bool:
        """Whether the step may not be applied and the run ends FLOAT8_DRIFT."""
        return self.action is Float8Drift.STOP


@attrs.frozen
class ReplicaStep:
    """How a step went under ``[fault_tolerance]``: the replica groups that took part in the
    attempt that committed, the attempts before it that did not (a group lost inside them:
    their rows are read again), and a heal: the step this group received from a live peer
    (``rebase``: the loop state it continues from, when it healed inside the loop; a heal at
    set-up starts the loop there) and how long the quorum that carried it took (0: none)."""

    participants: int
    failed_attempts: int = 0
    rebase: LoopState | None = None
    heal_s: float = 0.0


@attrs.frozen
class StepResult:
    """What one optimizer step reports back. ``grad_norm`` is global (every shard and
    stage), ``tokens`` and ``images`` count over the data-parallel ranks; ``loss``,
    ``z_loss``, ``moe`` and ``sources`` are this rank's, reduced over ranks when logged."""

    loss: float
    grad_norm: float
    tokens: int
    lr: float
    collective_failed: bool = False  # a peer stalled or died during the step
    z_loss: float | None = None  # mean logsumexp² when train.z_loss_weight > 0 (not in ``loss``)
    moe: MoeStepStats | None = None  # a mixture-of-experts model's routing (losses not in ``loss``)
    freeze: FreezeTransition | None = None  # the trainable set changed before this step
    images: int = 0  # images the step trained on, over every data-parallel rank (VLM)
    sources: SourceTotals | None = None  # a mixture's per-source loss and tokens, this rank
    world_loss: float | None = None  # the loss over every rank, when the spike rule needs it
    spike: bool = False  # the loss was a spike (resilience.spike_threshold)
    replay: ReplayVerdict | None = None  # the step was replayed, and how it came out
    busy_s: float = 0.0  # this rank's own time in the step, its waits for peers left out
    applied: bool = True  # the step applied its update (false: non-finite, dropped, failed)
    mtp: tuple[float, ...] | None = None  # each multi-token depth's mean loss (not in ``loss``)
    float8: Float8Verdict | None = None  # the step was checked against high precision
    replicas: ReplicaStep | None = None  # replica groups ([fault_tolerance]): who took part

    @property
    def finite(self) -> bool:
        """Loss, grad norm and every auxiliary loss finite: the update may be applied."""
        z_finite = self.z_loss is None or math.isfinite(self.z_loss)
        moe_finite = self.moe is None or self.moe.finite
        mtp_finite = self.mtp is None or all(math.isfinite(v) for v in self.mtp)
        return (
            math.isfinite(self.loss)
            and math.isfinite(self.grad_norm)
            and z_finite
            and moe_finite
            and mtp_finite
        )


@attrs.frozen
class PendingStep:
    """The optimizer step about to be applied: its number (1-based) and what it measured,
    the global gradient norm before clipping included; ``result.finite`` says whether the
    update will happen."""

    step: int
    result: StepResult


@attrs.frozen
class Signals:
    """Conditions polled once per step, already reduced over every rank (the control word)."""

    shutdown_requested: bool = False
    health_failed: bool = False
    nonfinite: bool = False  # some rank's loss or grad norm was not finite
    replay_failed: bool = False  # a replayed step found no majority, or replicas diverged
    float8_stopped: bool = False  # an FP8 step drifted and train.float8_on_drift is "stop"
    save_unwritten: bool = False  # some rank's async save is still being written
    # a save is in flight and every rank has written it (not exchanged: read off the word
    # by ``StepMonitor``): commit it now, not at the next save
    save_written: bool = False


class RemoteLocation(Protocol):
    """A checkpoint in an object store (``forge.checkpoint.object_path.ObjectPath``)."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...


class Hooks:
    """Callbacks at fixed points of a run; a no-op base whose every method is optional.
    Subclass it (as ``forge.training.loop.hooks.Hooks``) and override what you need."""

    def on_train_begin(self, state: LoopState) -> None:
        """Before the first step (also on resume)."""

    def on_before_optimizer_step(
        self, state: PendingStep, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """On every rank, after the step's gradients are accumulated (and reduced) and before
        they are clipped and applied; ``state.result.grad_norm`` is the global norm."""

    def on_step_end(self, state: LoopState, result: StepResult) -> None:
        """After every step and its effects."""

    def on_checkpoint_save(self, step: int, path: pathlib.Path | RemoteLocation) -> None:
        """On rank 0, after a checkpoint is committed (``latest`` points at it); ``path`` is
        a ``RemoteLocation`` when ``checkpoint.dir`` is an object-store URL."""

    def on_eval_end(self, state: LoopState, loss: float) -> None:
        """On every rank, after an evaluation; ``loss`` is the mean over data-parallel ranks."""

    def on_train_end(self, outcome: LoopOutcome, state: LoopState) -> None:
        """After the final save and the wait."""
