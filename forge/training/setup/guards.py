"""Every guard the config turns on, armed or refused: what a start says of its resilience.

A guard configured but unable to act in this run is worse than none: the user counts on it.
So at start-up, once the layout is built, ``guard_facts`` reads what each guard's mechanism
can do here off the built objects themselves (the loop's policy, the step's spec, the model's
parameters, the signal handlers, the checkpoint storage), and ``guard_report`` (pure,
table-tested) decides: the one line a launch prints (``[forge] guards: ...``), or the
refusals, one per guard that cannot act, before anything is written.
"""

from __future__ import annotations

import enum
import functools
import pathlib
import tempfile
import time
from collections.abc import Sequence

import attrs
import torch

from forge.config.ranges import Problem
from forge.config.sections import JobConfig, NonFinitePolicy, ResilienceConfig, SpikePolicy
from forge.errors import UserInputError
from forge.parallel.mesh import every_rank
from forge.resilience import stragglers
from forge.resilience.control import ControlChannel
from forge.resilience.signals import ShutdownFlag
from forge.resilience.stacks import StackWatch, stacks_path
from forge.training.context import DataContext, DistContext, ModelContext, RunContext
from forge.training.loop.plan import LoopPolicy, ReplayRule
from forge.training.steps.float8_check import Float8CheckRule
from forge.training.steps.float8_check import float8_layers as fp8_layers
from forge.training.steps.replay import (
    checks_kernels,
    replicated_along,
    unverifiable_operations,
)
from forge.training.steps.select import computation_for
from forge.training.steps.spec import StepSpec, step_spec
from forge.types import LoopState, StepResult

DEFAULTS = ResilienceConfig()


class Guard(enum.Enum):
    """The guards a start reports, in the order of its line."""

    NONFINITE = "nonfinite"
    SPIKES = "spikes"
    REPLAY = "replay"
    REPLICAS = "replicas"
    STRAGGLERS = "stragglers"
    HEALTH = "health"
    HANG_STACKS = "hang stacks"
    SIGNALS = "signals"
    CHECKSUMS = "checksums"
    FLOAT8 = "float8 check"


class GuardRefused(UserInputError):
    """A guard the config turns on cannot act in this run."""


@attrs.frozen
class GuardFacts:
    """What each guard's mechanism can do in this run, read off the built run."""

    world_size: int
    cuda: bool
    snapshots: bool  # the loop keeps a rollback snapshot (its policy)
    spike_threshold: float  # the threshold the step measures spikes with (0: none)
    drops_spikes: bool  # the step drops a spike's update
    replay: ReplayRule  # the steps the step computes twice
    replica_layout: int  # dp_replicate × tp: > 1 promises replicas to compare
    replicated: int  # parameters held bit for bit by other ranks (what replicas compare)
    signals: bool  # SIGTERM, SIGUSR1 and SIGINT reach forge's shutdown flag, unblocked
    health: bool = True  # the control word has a group of its own (several ranks)
    straggler_clock: bool = True  # the step reports its own time
    hang_watch: bool = True  # the watchdog writes a rank's stacks when no step ends in time
    float8_check: Float8CheckRule = attrs.Factory(Float8CheckRule)  # the step's drift guard
    float8_layers: int = 0  # the model's layers that compute in FP8
    # operations this rank's step runs without a deterministic kernel (``kernel_probe``)
    unverifiable: tuple[str, ...] = ()


def guard_report(config: JobConfig, facts: GuardFacts) -> tuple[str, list[Problem]]:
    """The words of each armed guard, joined for the start's line, and the refusals of the
    guards the config turns on that cannot act here."""
    res = config.resilience
    armed: list[str] = []
    refused: list[Problem] = []
    rollback = res.on_nonfinite is NonFinitePolicy.ROLLBACK or (
        res.spike_threshold > 0 and res.on_spike is SpikePolicy.ROLLBACK
    )
    if rollback and not facts.snapshots:
        refused.append(
            ("resilience.on_nonfinite", "rollback is on, but the loop keeps no snapshot")
        )
    armed.append(f"{Guard.NONFINITE.value}={res.on_nonfinite.value}")
    if res.spike_threshold > 0:
        drops = res.on_spike is not SpikePolicy.WARN
        if facts.spike_threshold != res.spike_threshold or facts.drops_spikes != drops:
            refused.append(
                ("resilience.spike_threshold", "is set, but the step does not measure spikes")
            )
        armed.append(f"{Guard.SPIKES.value}={res.on_spike.value}({res.spike_threshold:g}σ)")
    elif res.on_spike is not SpikePolicy.WARN:
        refused.append(
            (
                "resilience.on_spike",
                f"{res.on_spike.value!r} has no effect: resilience.spike_threshold = 0 turns "
                "the spike rule off; set a threshold (e.g. 6) or leave on_spike at 'warn'",
            )
        )
    wanted = ReplayRule(res.replay_interval, res.replay_first_step)
    if wanted != ReplayRule():
        if facts.replay != wanted:
            refused.append(
                ("resilience.replay_interval", "replays are on, but the step replays nothing")
            )
        armed.append(replay_words(wanted, facts))
        if facts.unverifiable:
            refused.append(("resilience.replay_interval", unverifiable_words(facts)))
        if facts.replica_layout > 1 and facts.replicated == 0:
            refused.append(
                (
                    "distributed.dp_replicate",
                    f"the layout has {facts.replica_layout} replicas (dp_replicate × tp), but "
                    "no parameter is replicated across them: the replica comparison of "
                    "replayed steps would compare nothing",
                )
            )
    if (straggler_key := changed_key(res, STRAGGLER_KEYS)) is not None and facts.cuda:
        refused.append(
            (
                straggler_key,
                "is set, but stragglers are read on the CPU only (on CUDA a rank's CPU time "
                "does not tell waiting from working: docs/resilience.md#stragglers); remove it",
            )
        )
    elif straggler_key is not None and facts.world_size == 1:
        refused.append(
            (
                straggler_key,
                "is set, but a run of one process has no other rank to be slower than; "
                "remove it (or launch the run on several ranks)",
            )
        )
    if (health_key := changed_key(res, HEALTH_KEYS)) is not None and facts.world_size == 1:
        refused.append(
            (
                health_key,
                "is set, but a run of one process has no peer whose death or stall the "
                "control word could find; remove it (or launch the run on several ranks)",
            )
        )
    if facts.world_size > 1 and not facts.health:
        refused.append(
            (
                "resilience.health_timeout_s",
                "the control word has no group of its own: a rank that died or stalled would "
                "go unnoticed until a collective's timeout, and no rank would agree to stop",
            )
        )
    if facts.world_size > 1 and not facts.cuda and not facts.straggler_clock:
        refused.append(
            (
                "resilience.straggler_ratio",
                "the step does not report its own time: a straggler would never be named",
            )
        )
    if facts.world_size > 1 and not facts.hang_watch:
        refused.append(
            (
                "distributed.timeout_s",
                "the hang watchdog writes no stacks: a rank that hangs would leave no trace "
                "of where it waited",
            )
        )
    if facts.world_size > 1:
        if not facts.cuda:
            armed.append(f"{Guard.STRAGGLERS.value}({res.straggler_ratio:g}x)")
        armed.append(f"{Guard.HEALTH.value}({res.health_timeout_s:g} s)")
        armed.append(f"{Guard.HANG_STACKS.value}({config.distributed.timeout_s:g} s)")
    if not facts.signals:
        refused.append(
            (
                "resilience.shutdown_timeout_s",
                "SIGTERM, SIGUSR1 or SIGINT does not reach forge's handler (another handler "
                "took its place, or the process blocks it): a preemption would end the run "
                "without its emergency save",
            )
        )
    checkpointing = config.checkpoint.enabled
    armed.append(Guard.SIGNALS.value + ("" if checkpointing else "(no checkpoint)"))
    if checkpointing:  # every commit records them; a resume fails closed without them
        armed.append(f"{Guard.CHECKSUMS.value}({config.checkpoint.verify.value})")
    t = config.train
    if t.float8_check > 0:
        rule = Float8CheckRule(
            t.float8_check, t.float8_check_tolerance, t.float8_check_grad_tolerance,
            t.float8_on_drift,
        )  # fmt: skip
        if facts.float8_check != rule or facts.float8_layers == 0:
            refused.append(
                (
                    "train.float8_check",
                    "is set, but the step compares no FP8 layer with high precision",
                )
            )
        armed.append(
            f"{Guard.FLOAT8.value} every {rule.interval} ({percent(rule.tolerance)} loss, "
            f"{percent(rule.grad_tolerance)} grad norm: {rule.on_drift.value})"
        )
    return ", ".join(armed), refused


def percent(fraction: float) -> str:
    """``fraction`` as a percentage, its digits kept (0.005 is 0.5%, not 0%)."""
    return f"{fraction * 100:g}%"


def replay_words(rule: ReplayRule, facts: GuardFacts) -> str:
    """``replay every 50 + first step (2 replicas)``: which steps, and what else they check."""
    when = [f"every {rule.interval}"] if rule.interval else []
    when += ["first step"] if rule.first_step else []
    replicas = f" ({facts.replica_layout} replicas)" if facts.replicated else ""
    return f"{Guard.REPLAY.value} {' + '.join(when)}{replicas}"


def unverifiable_words(facts: GuardFacts) -> str:
    """Why replays cannot act where the step runs operations without a deterministic kernel."""
    return (
        f"replays compare a step's computations bit for bit, but the step runs "
        f"{', '.join(facts.unverifiable)} without a deterministic kernel: two computations may "
        "differ on healthy hardware, and a fault could not be told from noise; set "
        "resilience.replay_interval = 0 and resilience.replay_first_step = false "
        "(docs/resilience.md#replayed-steps)"
    )


def agreed_refusals(per_rank: Sequence[Sequence[Problem]]) -> list[Problem]:
    """Every rank's refusals (``per_rank[r]``: rank ``r``'s), each once, in the order first
    found: one that some ranks only found names them (a blocked signal or a kernel can differ
    per node), one found on every rank reads as is. Every rank then refuses alike, and none
    waits for a peer that has stopped."""
    found: dict[Problem, list[int]] = {}
    for rank, problems in enumerate(per_rank):
        for problem in problems:
            found.setdefault(problem, []).append(rank)
    everywhere = len(per_rank)
    return [
        (key, message if len(ranks) == everywhere else f"{message} (on {rank_span(ranks)})")
        for (key, message), ranks in found.items()
    ]


def rank_span(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 1, 3`` or ``ranks 8-15, 20``: runs of consecutive ranks kept short."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    words = [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(words)


STRAGGLER_KEYS = ("straggler_ratio", "straggler_logs")  # the straggler reading's
HEALTH_KEYS = ("health_timeout_s", "health_check_interval")  # the control word's checks


def changed_key(res: ResilienceConfig, names: Sequence[str]) -> str | None:
    """The first of ``names`` (``[resilience]`` keys) that the config changes from its
    default, as a config spells it; None when it changes none."""
    for name in names:
        if getattr(res, name) != getattr(DEFAULTS, name):
            return f"resilience.{name}"
    return None


def guard_facts(
    config: JobConfig,
    policy: LoopPolicy,
    spec: StepSpec,
    params: Sequence[torch.nn.Parameter],
    world_size: int,
    signals: bool,
    health: bool = True,
    unverifiable: tuple[str, ...] = (),
) -> GuardFacts:
    """What each guard can do in the run built from ``config`` (``unverifiable``: what the
    kernel probe named on this rank)."""
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
    stacks when no step ends in time: armed for 1 ms, it must write within 10 s (a few
    milliseconds when it works; the bound only spares a loaded machine a false refusal)."""
    with tempfile.TemporaryDirectory() as folder:
        watch = StackWatch(stacks_path(pathlib.Path(folder), 0), 0.001)
        try:
            watch.arm()
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                if watch.path.stat().st_size > 0:
                    return True
                time.sleep(0.002)
            return False
        finally:
            watch.close()


def kernel_probe(
    run: RunContext, dist: DistContext, model: ModelContext, data: DataContext
) -> tuple[str, ...]:
    """Where replays are configured on a device whose kernels a replay checks
    (``checks_kernels``): the operations without a deterministic kernel that the first
    step's computation runs on this rank (its own micro-batches, read without moving the
    loader). Nothing elsewhere."""
    res = run.config.resilience
    replays = ReplayRule(res.replay_interval, res.replay_first_step) != ReplayRule()
    if not replays or not checks_kernels(dist.device):
        return ()
    first = data.train_loader.step_share(range(run.config.train.grad_accum_steps))
    if first is None:  # no step to run (refused at set-up: the data holds one at least)
        return ()
    spec = step_spec(run, dist, model, data)
    spec.model.train()
    reset = functools.partial(model.optimizer.zero_grad, set_to_none=True)
    return unverifiable_operations(computation_for(spec, model)(first[0], 1), reset, dist.device)


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
    refused = agreed_refusals(every_rank(refused, dist.world_size))
    if refused:
        raise GuardRefused([f"{key}: {message}" for key, message in refused])
    return f"guards: {words}"
