"""Every guard the config turns on, armed or refused: what a start says of its resilience.

A guard configured but unable to act in this run is worse than none: the user counts on it.
So at start-up, once the layout is built, ``guard_facts`` reads what each guard's mechanism
can do here off the built objects themselves (the loop's policy, the step's spec, the model's
parameters, the signal handlers, a kernel probe of the first step), ``guard_report``
(``forge.training.setup.guard_rules``: pure, table-tested) decides, and the ranks agree: the
one line a launch prints (``[forge] guards: ...``), or every rank's refusals, one per guard
that cannot act, before anything is written.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import pathlib
import tempfile
import time
from collections.abc import Sequence

import torch

from forge.config.sections import JobConfig
from forge.errors import UserInputError
from forge.parallel.mesh import from_every_rank
from forge.resilience import stragglers
from forge.resilience.control import ControlChannel
from forge.resilience.signals import ShutdownFlag
from forge.resilience.stacks import StackWatch, stacks_path
from forge.training.context import DataContext, DistContext, ModelContext, RunContext
from forge.training.loop.plan import LoopPolicy, ReplayRule
from forge.training.setup.guard_rules import (
    GuardFacts,
    agreed_refusals,
    guard_report,
    operations_by_rank,
)
from forge.training.steps.float8_check import float8_layers as fp8_layers
from forge.training.steps.replay import (
    checks_kernels,
    replicated_along,
    unverifiable_operations,
)
from forge.training.steps.select import computation_for
from forge.training.steps.spec import StepSpec, step_spec
from forge.types import LoopState, StepResult


class GuardRefused(UserInputError):
    """A guard the config turns on cannot act in this run."""


def guard_facts(
    config: JobConfig,
    policy: LoopPolicy,
    spec: StepSpec,
    params: Sequence[torch.nn.Parameter],
    world_size: int,
    signals: bool,
    health: bool = True,
    unverifiable: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> GuardFacts:
    """What each guard can do in the run built from ``config`` (``unverifiable``: what the
    kernel probe named, by the ranks that run it)."""
    dims = config.distributed
    return GuardFacts(
        world_size=world_size,
        cuda=torch.cuda.is_available(),
        snapshots=policy.snapshots,
        spike_threshold=spec.spike_threshold,
        drops_spikes=spec.drops_spike,
        replay=spec.replay,
        replica_layout=dims.dp_replicate * dims.tp,
        replicated=sum(bool(replicated_along(p)) for p in params),
        signals=signals,
        health=health,
        straggler_clock=measures_own_time(),
        hang_watch=world_size == 1 or dumps_stacks(),
        float8_check=spec.float8_check,
        float8_layers=len(fp8_layers(spec.model)) if spec.float8_check.interval else 0,
        unverifiable=unverifiable,
    )


def measures_own_time() -> bool:
    """Whether the straggler clock the loop wraps its step in reports a step's own time: a
    step that keeps busy for 2 ms of CPU time must report some."""

    def busy(batch: object, state: LoopState) -> StepResult:
        end = time.process_time() + 0.002
        while time.process_time() < end:
            pass
        return StepResult(loss=0.0, grad_norm=0.0, tokens=0, lr=0.0)

    return stragglers.timed(busy)(None, LoopState()).busy_s > 0


def dumps_stacks() -> bool:
    """Whether the watchdog a rank re-arms after every step (``StackWatch``) writes the
    stacks when no step ends in time: armed for 20 ms, it must write within 10 s (a few
    tens of milliseconds when it works; the bound only spares a loaded machine a false
    refusal). The watchdog reads every thread's frames without the GIL, so this thread
    waits in C calls only, its frames still (``arm`` returns well within the 20 ms before
    the watchdog fires): ``time.sleep``, ``os.fstat`` and, once the dump has begun, the
    cancel, which returns when the dump has ended."""
    with tempfile.TemporaryDirectory() as folder:
        watch = StackWatch(stacks_path(pathlib.Path(folder), 0), 0.02)
        try:
            watch.arm()
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                time.sleep(0.005)
                if os.fstat(watch.file.fileno()).st_size > 0:
                    faulthandler.cancel_dump_traceback_later()
                    return True
            return False
        finally:
            watch.close()


def kernel_probe(
    run: RunContext, dist: DistContext, model: ModelContext, data: DataContext
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Where replays are configured on a device whose kernels a replay checks
    (``checks_kernels``): the operations without a deterministic kernel that a step's
    computation runs (each rank its own first rows of the data, read without moving the
    loader: one micro-batch, or a pipeline's whole step, which its schedule needs), each
    with the ranks that run it, gathered from every rank. Nothing elsewhere (every rank
    knows alike whether it probes: the config and the device type)."""
    if ReplayRule.configured(run.config) == ReplayRule() or not checks_kernels(dist.device):
        return ()
    micro = run.config.train.grad_accum_steps if model.pipeline is not None else 1
    first = data.train_loader.step_share(range(micro))
    mine: tuple[str, ...] = ()
    if first is not None:  # else no step to run (refused at set-up: the data holds one)
        spec = step_spec(run, dist, model, data)
        spec.model.train()
        reset = functools.partial(model.optimizer.zero_grad, set_to_none=True)
        compute = computation_for(spec, model)(first[0], 1)
        mine = unverifiable_operations(compute, reset, dist.device)
    return operations_by_rank(from_every_rank(mine, dist.world_size))


def armed_guards(
    run: RunContext,
    dist: DistContext,
    model: ModelContext,
    data: DataContext,
    flag: ShutdownFlag,
    channel: ControlChannel | None = None,
) -> str:
    """The start's line of its guards, read off the built run; ``GuardRefused`` naming each
    guard the config turns on that cannot act here, on any rank (before anything is
    written)."""
    facts = guard_facts(
        run.config,
        run.policy,
        step_spec(run, dist, model),
        list(model.model.parameters()),
        dist.world_size,
        flag.reaches(),
        health=channel is None or dist.world_size == 1 or channel.group is not None,
        unverifiable=kernel_probe(run, dist, model, data),
    )
    words, refused = guard_report(run.config, facts)
    refused = agreed_refusals(from_every_rank(refused, dist.world_size))
    if refused:
        raise GuardRefused([f"{key}: {message}" for key, message in refused])
    return f"guards: {words}"
