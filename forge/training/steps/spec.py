"""``StepSpec``: everything a step function needs, named once, built once from the contexts.

A new step option is one field here and one line in ``step_spec``; the builders
(``text.py``, ``pipeline.py``) read it, never a parameter list threaded through layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch
from torch import nn

from forge.config.sections import ModelConfig, Precision, VlmArch
from forge.data.batch import Batch
from forge.model.chunked_loss import PLAIN_LOSS, LossSpec
from forge.model.moe import stats_width
from forge.optim.schedules import Schedule
from forge.training.context import DataContext, DistContext, ModelContext, RunContext
from forge.training.loop.hooks import Hooks
from forge.training.loop.plan import ReplayRule
from forge.training.steps.float8_check import Float8CheckRule
from forge.types import LoopState, PendingStep, StepResult

StepFunction = Callable[[tuple[Batch, ...], LoopState], StepResult]  # one optimizer step


class GradientFault(Protocol):
    """A test-only fault (``forge.resilience.faults``) applied to one computation of a step
    after its backward: it may change the gradients of ``params`` in place, and returns the
    loss the computation reports."""

    def __call__(
        self, step: int, computation: int, params: Sequence[torch.Tensor], loss: torch.Tensor
    ) -> torch.Tensor: ...


class ReplicaSums(Protocol):
    """What a step asks of the replica groups (``[fault_tolerance]``;
    ``forge.training.steps.replicas.StepReplicas``): the step's labels and, after the
    backward, its gradients and totals summed over the groups taking part, then the commit
    before the optimizer step. ``slots``: the micro-batches of the whole step."""

    slots: int

    def labels(self, total: torch.Tensor) -> torch.Tensor: ...
    def totals(
        self, params: Sequence[torch.Tensor], vetoed: bool, *tensors: torch.Tensor | None
    ) -> None: ...
    def commit(self) -> bool: ...


@attrs.frozen
class StepSpec:
    """What every step needs: the model (or this rank's pipeline stage) and its optimizer,
    the LR schedule and peak, the compute precision, clipping, the data-parallel size, how the
    loss is computed, a mixture-of-experts model's statistics shape and bias rate, the
    mixture's sources and the hooks' ``before_update``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    peak_lr: float
    precision: Precision = Precision.FP32
    grad_clip_norm: float | None = None  # None: no clipping (the norm is still measured)
    fsdp_mixed_precision: bool = False  # FSDP2 applies the compute dtype itself: no autocast
    # ranks holding distinct tokens (data-parallel × context-parallel): tokens and label
    # shares count over them
    token_slices: int = 1
    world_size: int = 1  # every rank: the MoE bias update sums the expert loads over them
    rank: int = 0  # this rank: a replayed step's verdict names ranks
    loss: LossSpec = PLAIN_LOSS
    moe_shape: tuple[int, int] | None = None  # (MoE layers, statistics columns); None: dense
    bias_rate: float = 0.0  # aux-loss-free balancing (0: off)
    sources: tuple[str, ...] = ()  # a mixture's sources, whose losses the step reports
    before_update: Callable[[PendingStep], None] | None = None  # hooks, before clip and update
    vlm: VlmArch | None = None  # a vision-language step's architecture
    spike_threshold: float = 0.0  # resilience.spike_threshold (0: no spike rule)
    drops_spike: bool = False  # a spiking step's update is dropped (on_spike skip, rollback)
    replay: ReplayRule = attrs.Factory(ReplayRule)  # which steps are computed again and compared
    # which steps are also computed in high precision, and what a drift does (FP8 runs)
    float8_check: Float8CheckRule = attrs.Factory(Float8CheckRule)
    float8_fallen_back: bool = False  # before this launch: nothing left to check
    fault: GradientFault | None = None  # test-only faults in the step's computations
    replicas: ReplicaSums | None = None  # replica groups ([fault_tolerance]); None: none

    @property
    def max_norm(self) -> float:
        """The clipping threshold (infinite: off)."""
        return math.inf if self.grad_clip_norm is None else self.grad_clip_norm


def moe_stats_shape(cfg: ModelConfig) -> tuple[int, int] | None:
    """The shape of a mixture-of-experts model's statistics (None when dense)."""
    return (len(cfg.moe_layers), stats_width(cfg.moe_num_experts)) if cfg.moe else None


def call_before_update(
    hooks: Hooks, model: nn.Module, optimizer: torch.optim.Optimizer, pending: PendingStep
) -> None:
    """``hooks.on_before_optimizer_step`` in the step's ``before_update`` shape."""
    hooks.on_before_optimizer_step(pending, model, optimizer)


def step_spec(
    run: RunContext,
    dist: DistContext,
    model: ModelContext,
    data: DataContext | None = None,
    hooks: Hooks | None = None,
    fault: GradientFault | None = None,
    replicas: ReplicaSums | None = None,
) -> StepSpec:
    """The run's ``StepSpec``, from its contexts (``data`` names a mixture's sources;
    ``hooks`` get ``on_before_optimizer_step``; ``fault``: test-only; ``replicas``: the
    replica groups')."""
    cfg = run.config
    before_update = None
    if hooks is not None:
        before_update = functools.partial(call_before_update, hooks, model.model, model.optimizer)
    return StepSpec(
        model=model.model,
        optimizer=model.optimizer,
        schedule=model.schedule,
        peak_lr=cfg.optimizer.lr if model.peak_lr is None else model.peak_lr,
        precision=cfg.train.mixed_precision,
        grad_clip_norm=cfg.train.grad_clip_norm,
        fsdp_mixed_precision=model.fsdp,
        token_slices=dist.token_slices,
        world_size=dist.world_size,
        rank=dist.rank,
        loss=model.loss,
        moe_shape=moe_stats_shape(cfg.model),
        bias_rate=cfg.model.moe_bias_update_rate if cfg.model.moe else 0.0,
        sources=data.source_names if data is not None else (),
        before_update=before_update,
        vlm=cfg.model.vlm,
        spike_threshold=cfg.resilience.spike_threshold,
        drops_spike=run.policy.drops_spikes,
        replay=ReplayRule.configured(cfg),
        float8_check=Float8CheckRule(
            cfg.train.float8_check,
            cfg.train.float8_check_tolerance,
            cfg.train.float8_check_grad_tolerance,
            cfg.train.float8_on_drift,
        ),
        float8_fallen_back=model.float8_fallen_back,
        fault=fault,
        replicas=replicas,
    )
