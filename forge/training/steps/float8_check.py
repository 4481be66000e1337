"""The FP8 drift guard (``train.float8_check``; docs/precision.md#the-drift-guard).

Every ``float8_check`` steps the step's gradients are first computed in high precision (every
FP8 layer computing as the plain ``Linear`` it replaced), their loss and gradient
norm kept and the gradients dropped; then the step runs in FP8 as usual. The relative
differences of the two losses and the two norms, the MAX over every rank, are the step's
``Float8Verdict``: past ``float8_check_tolerance`` (the loss's) or
``float8_check_grad_tolerance`` (the norm's), FP8 has drifted, and the run warns, falls
back to high precision for the rest of the run (its resumes too: ``LoopState``'s
``float8_fallback_step``), or stops (``float8_on_drift``). The RNG
state is restored between the two computations, as a replay does. What it costs: one more
forward and backward every ``float8_check`` steps, in high precision.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterator

import attrs
import torch
import torch.distributed as torch_dist
from torch import nn

from forge.config.train import Float8Recipe
from forge.training.context import ModelContext
from forge.types import Float8Drift, Float8Verdict

Computation = Callable[[int], object]


@attrs.frozen
class Float8CheckRule:
    """``train.float8_check`` (0: off), its tolerances (of the loss, of the gradient norm)
    and ``train.float8_on_drift``."""

    interval: int = 0
    tolerance: float = 0.05
    grad_tolerance: float = 0.5
    on_drift: Float8Drift = Float8Drift.WARN

    def checks(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is also computed in high precision."""
        return self.interval > 0 and step % self.interval == 0


def relative_drift(value: float, reference: float) -> float:
    """``|value - reference| / |reference|``: 0 where both are 0, and where the reference (the
    high-precision computation) is not finite — the step fails without FP8 too, and is the
    non-finite policy's, not the drift guard's; inf where only ``value`` is not finite."""
    if not math.isfinite(reference):
        return 0.0
    if not math.isfinite(value):
        return math.inf
    if value == reference:
        return 0.0
    return abs(value - reference) / abs(reference) if reference else math.inf


def float8_verdict(
    loss_drift: float, grad_norm_drift: float, rule: Float8CheckRule
) -> Float8Verdict:
    """The verdict of drifts agreed by every rank: ``rule.on_drift`` when either is past its
    tolerance (or not finite), else no action."""
    drifted = not (loss_drift <= rule.tolerance and grad_norm_drift <= rule.grad_tolerance)
    return Float8Verdict(loss_drift, grad_norm_drift, rule.on_drift if drifted else None)


def float8_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that compute in FP8 (torchao's ``Float8Linear``)."""
    from torchao.float8.float8_linear import Float8Linear

    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def compute_in_high_precision(layers: list[nn.Module]) -> None:
    """``layers`` computing as the plain ``Linear`` they replaced (their weights are the same
    tensors). A compiled block sees the change (dynamo guards each module's ``forward``) and
    keeps a graph for each."""
    for layer in layers:
        layer.forward = types.MethodType(nn.Linear.forward, layer)


def kept_fallback(
    model: ModelContext, recipe: Float8Recipe, fallback_step: int | None
) -> ModelContext:
    """``model`` of a resumed run whose FP8 fell back at ``fallback_step`` (None: it did not):
    its FP8 layers compute in high precision from the first step, as the run never
    interrupted does, whatever ``train.float8_on_drift`` says now, and its steps check
    nothing (``float8_fallen_back``); ``model`` itself without FP8 layers
    (``train.float8 = "off"``: the same computation)."""
    if fallback_step is None or recipe is Float8Recipe.OFF:
        return model
    layers = float8_layers(model.model)
    if not layers:
        return model
    compute_in_high_precision(layers)
    return attrs.evolve(model, float8_fallen_back=True)


@contextlib.contextmanager
def high_precision(layers: list[nn.Module]) -> Iterator[None]:
    """``layers`` computing in high precision while inside (``compute_in_high_precision``)."""
    compute_in_high_precision(layers)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's FP8 forward again


class Float8Check:
    """The guard for one launch: ``reference`` before the step's computation, ``verdict``
    after it."""

    def __init__(
        self,
        rule: Float8CheckRule,
        model: nn.Module,
        reset: Callable[[], None],
        world_size: int,
        fallen_back: bool = False,
    ) -> None:
        self.rule = rule
        self.layers = float8_layers(model) if rule.interval > 0 else []
        self.device = next(model.parameters()).device
        self.reset = reset  # drops the reference computation's gradients
        self.world_size = world_size
        self.fallen_back = fallen_back  # before this launch (``kept_fallback``): nothing to check

    def reference(self, step: int, compute: Computation) -> tuple[float, float] | None:
        """The high-precision loss and gradient norm of step ``step`` where it is checked
        (its gradients dropped, the RNG as it was), else None."""
        if self.fallen_back or not self.rule.checks(step):
            return None
        rng = torch.get_rng_state()
        with high_precision(self.layers):
            totals = compute(0)
        values = (float(totals.loss), float(totals.grad_norm))  # type: ignore[attr-defined]
        self.reset()
        torch.set_rng_state(rng)
        return values

    def verdict(
        self, reference: tuple[float, float] | None, totals: object
    ) -> Float8Verdict | None:
        """The checked step's verdict, agreed by every rank (None for a step not checked);
        where the rule says so, the model computes in high precision from here on (training,
        evaluation, everything) for the rest of the run, its resumes too (``kept_fallback``)."""
        if reference is None:
            return None
        loss, grad_norm = float(totals.loss), float(totals.grad_norm)  # type: ignore[attr-defined]
        drifts = torch.tensor(
            [relative_drift(loss, reference[0]), relative_drift(grad_norm, reference[1])],
            dtype=torch.float64,
            device=self.device,
        )
        if self.world_size > 1:
            torch_dist.all_reduce(drifts, op=torch_dist.ReduceOp.MAX)
        verdict = float8_verdict(float(drifts[0]), float(drifts[1]), self.rule)
        if verdict.action is Float8Drift.FALLBACK:
            compute_in_high_precision(self.layers)
            self.fallen_back = True
        return verdict
