"""The one place that chooses a run's step: text, vision-language or pipeline, then the
freeze schedule around it. A new kind of step is a builder module and one branch here."""

from __future__ import annotations

import functools

import attrs

from forge.data.batch import Batch
from forge.optim.freezing import Freezer
from forge.training.context import DataContext, DistContext, ModelContext, RunContext
from forge.training.loop.hooks import Hooks
from forge.training.steps.pipeline import make_pipeline_step, pipeline_computation
from forge.training.steps.replay import StepComputation
from forge.training.steps.spec import (
    GradientFault,
    ReplicaSums,
    StepFunction,
    StepSpec,
    step_spec,
)
from forge.training.steps.text import make_text_step, make_vlm_step, text_computation
from forge.types import LoopState, StepResult


def make_step_fn(
    run: RunContext,
    dist: DistContext,
    model: ModelContext,
    data: DataContext | None = None,
    hooks: Hooks | None = None,
    fault: GradientFault | None = None,
    replicas: ReplicaSums | None = None,
) -> StepFunction:
    """The step function the config selects (``step_for``), over the run's ``StepSpec``
    (``data`` names a mixture's sources; ``hooks.on_before_optimizer_step`` runs inside
    it; ``fault``: test-only; ``replicas``: the replica groups'); with ``[[freeze]]`` the
    schedule's transitions run before it."""
    step = step_for(step_spec(run, dist, model, data, hooks, fault, replicas), model)
    if model.freezer is None:
        return step
    return functools.partial(freezing_step, step, model.freezer)


def step_for(spec: StepSpec, model: ModelContext) -> StepFunction:
    """The vision-language step (``model.vlm``), the pipeline step (``distributed.pp > 1``),
    else the text LM step."""
    if spec.vlm is not None:
        return make_vlm_step(spec)
    if model.pipeline is not None:
        return make_pipeline_step(spec, model.pipeline)
    return make_text_step(spec)


def computation_for(spec: StepSpec, model: ModelContext) -> StepComputation:
    """One computation of the gradients of the step ``step_for`` chooses (a vision-language
    step computes as the text step, its batches carrying the images)."""
    if spec.vlm is None and model.pipeline is not None:
        return pipeline_computation(spec, model.pipeline)
    return text_computation(spec)


def freezing_step(
    step: StepFunction, freezer: Freezer, batches: tuple[Batch, ...], state: LoopState
) -> StepResult:
    """``step`` after the freeze schedule's transition for it, if any (reported in the
    result, as is the first step's trainable set)."""
    transition = freezer.apply(state.step + 1)
    if transition is None and state.step == 0 and freezer.rules:
        transition = freezer.counts(1)
    result = step(batches, state)
    return result if transition is None else attrs.evolve(result, freeze=transition)
