"""A step over one computation of its gradients (``text_computation``,
``pipeline_computation``): the FP8 drift check and the replay around that computation, the
replica groups' sums, then the update (``finish_step``). The text and the pipeline step are
this, over their own computations."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from forge.data.batch import Batch
from forge.parallel.grad_norm import global_grad_norm
from forge.training.steps.common import fails_alone, finish_step, over_groups, set_lr, step_lr
from forge.training.steps.float8_check import Float8Check
from forge.training.steps.replay import Replayer, StepComputation
from forge.training.steps.spec import StepFunction, StepSpec
from forge.types import LoopState, StepResult


def checked_step(
    spec: StepSpec,
    computation: StepComputation,
    norm_of: Callable[[Sequence[torch.Tensor]], torch.Tensor] = global_grad_norm,
) -> StepFunction:
    """One optimizer step over ``computation``: computed in high precision first where the
    FP8 check asks, replayed where the replay rule asks (both reset the gradients between
    computations), summed over the replica groups taking part (``norm_of`` the summed
    gradients: a pipeline's spans its stages), then applied if finite."""
    model, optimizer = spec.model, spec.optimizer

    def reset() -> None:
        optimizer.zero_grad(set_to_none=True)

    device = next(model.parameters()).device
    replayer = Replayer(spec.replay, reset, spec.world_size, spec.rank, device)
    float8_check = Float8Check(
        spec.float8_check, model, reset, spec.world_size, spec.float8_fallen_back
    )
    replicas = spec.replicas

    def step(batches: tuple[Batch, ...], state: LoopState) -> StepResult:
        lr = set_lr(optimizer, step_lr(spec, state, batches))
        model.train()
        number = state.step + 1
        compute = computation(batches, number)
        reference = float8_check.reference(number, compute)  # in high precision, where checked
        totals, verdict = replayer(number, compute)
        drift = float8_check.verdict(reference, totals)
        if replicas is not None:  # this group's step, checked; now the whole step's
            totals = over_groups(totals, replicas, fails_alone(verdict, drift), norm_of)
        return finish_step(spec, totals, number, lr, state.loss_stats, verdict, drift)

    return step
