"""The guards' rules (pure, table-tested): from what each guard's mechanism can do in a run
(``GuardFacts``, read off the built run by ``forge.training.setup.guards``) and the config,
the words a start says of each armed guard and the refusals of those that cannot act here.

One rule per guard, in the order of the start's line (``GUARD_RULES``); a new guard is a
``Guard`` member, a ``GuardFacts`` field and a rule here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import attrs

from forge.config.ranges import Problem
from forge.config.sections import JobConfig, NonFinitePolicy, ResilienceConfig, SpikePolicy
from forge.training.loop.plan import SPIKE_WARMUP, ReplayRule
from forge.training.steps.float8_check import Float8CheckRule

DEFAULTS = ResilienceConfig()
STRAGGLER_KEYS = ("straggler_ratio", "straggler_logs")  # the straggler reading's
HEALTH_KEYS = ("health_timeout_s", "health_check_interval")  # the control word's checks
OFF_VALUES = {"health_check_interval": 0}  # a key set to its off value turns nothing on


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
    # operations the step runs without a deterministic kernel, each with the ranks that run
    # it (the kernel probe's, gathered from every rank: ``operations_by_rank``)
    unverifiable: tuple[tuple[str, tuple[int, ...]], ...] = ()


# a guard's armed words (none when the config leaves it off) and its refusals
Verdict = tuple[list[str], list[Problem]]


def nonfinite_rule(config: JobConfig, facts: GuardFacts) -> Verdict:
    res = config.resilience
    rollback = res.on_nonfinite is NonFinitePolicy.ROLLBACK or (
        res.spike_threshold > 0 and res.on_spike is SpikePolicy.ROLLBACK
    )
    refused = []
    if rollback and not facts.snapshots:
        refused.append(
            ("resilience.on_nonfinite", "rollback is on, but the loop keeps no snapshot")
        )
    return [f"{Guard.NONFINITE.value}={res.on_nonfinite.value}"], refused


def spike_rule(config: JobConfig, facts: GuardFacts) -> Verdict:
    res, end = config.resilience, config.train.max_steps
    if res.spike_threshold <= 0:
        if res.on_spike is SpikePolicy.WARN:
            return [], []
        return [], [
            (
                "resilience.on_spike",
                f"{res.on_spike.value!r} has no effect: resilience.spike_threshold = 0 turns "
                "the spike rule off; set a threshold (e.g. 6) or leave on_spike at 'warn'",
            )
        ]
    refused = []
    drops = res.on_spike is not SpikePolicy.WARN
    if facts.spike_threshold != res.spike_threshold or facts.drops_spikes != drops:
        refused.append(
            ("resilience.spike_threshold", "is set, but the step does not measure spikes")
        )
    if end <= SPIKE_WARMUP:
        refused.append(
            (
                "resilience.spike_threshold",
                f"the spike rule first judges step {SPIKE_WARMUP + 1} (its statistics "
                f"need {SPIKE_WARMUP} applied steps), but the run ends at step {end} "
                "(train.max_steps): no loss of it could be called a spike; remove it, "
                "or train longer",
            )
        )
    return [f"{Guard.SPIKES.value}={res.on_spike.value}({res.spike_threshold:g}σ)"], refused


def replay_rule(config: JobConfig, facts: GuardFacts) -> Verdict:
    end = config.train.max_steps
    wanted = ReplayRule.configured(config)
    if wanted == ReplayRule():
        return [], []
    refused = []
    # the key that turns replays on: the interval where set, else the first step's (default)
    key = "resilience.replay_interval" if wanted.interval else "resilience.replay_first_step"
    if facts.replay != wanted:
        refused.append((key, "replays are on, but the step replays nothing"))
    if not wanted.first_step and wanted.interval > end:
        refused.append(
            (
                "resilience.replay_interval",
                f"replays every {wanted.interval} steps, but the run ends at step {end} "
                "(train.max_steps): no step of it is replayed; set an interval of at "
                f"most {end}, or resilience.replay_first_step = true",
            )
        )
    if facts.unverifiable:
        refused.append((key, unverifiable_words(facts.unverifiable, facts.world_size)))
    if facts.replica_layout > 1 and facts.replicated == 0:
        refused.append(
            (
                "distributed.dp_replicate",
                f"the layout has {facts.replica_layout} replicas (dp_replicate × tp), but "
                "no parameter is replicated across them: the replica comparison of "
                "replayed steps would compare nothing",
            )
        )
    return [replay_words(wanted, facts)], refused


def straggler_rule(config: JobConfig, facts: GuardFacts) -> Verdict:
    res = config.resilience
    key = changed_key(res, STRAGGLER_KEYS)
    if key is not None and facts.cuda:
        return [], [
            (
                key,
                "is set, but stragglers are read on the CPU only (on CUDA a rank's CPU time "
                "does not tell waiting from working: docs/resilience.md#stragglers); remove it",
            )
        ]
    if facts.world_size == 1:
        if key is None:
            return [], []
        return [], [
            (
                key,
                "is set, but a run of one process has no other rank to be slower than; "
                "remove it (or launch the run on several ranks)",
            )
        ]
    if facts.cuda:
        return [], []
    refused = []
    if not facts.straggler_clock:
        refused.append(
            (
                changed_key(res, STRAGGLER_KEYS) or "resilience.straggler_ratio",
                "the step does not report its own time: a straggler would never be named",
            )
        )
    return [f"{Guard.STRAGGLERS.value}({res.straggler_ratio:g}x)"], refused


def health_rule(config: JobConfig, facts: GuardFacts) -> Verdict:
    res = config.resilience
    if facts.world_size == 1:
        key = changed_key(res, HEALTH_KEYS)
        if key is None:
            return [], []
        return [], [
            (
                key,
                "is set, but a run of one process has no peer whose death or stall the "
                "control word could find; remove it (or launch the run on several ranks)",
            )
        ]
    refused = []
    if not facts.health:
        refused.append(
            (
                changed_key(res, HEALTH_KEYS) or "resilience.health_timeout_s",
                "the control word has no group of its own: a rank that died or stalled would "
                "go unnoticed until a collective's timeout, and no rank would agree to stop",
            )
        )
    return [f"{Guard.HEALTH.value}({res.health_timeout_s:g} s)"], refused


def hang_rule(config: JobConfig, facts: GuardFacts) -> Verdict:
    if facts.world_size == 1:
        return [], []
    refused = []
    if not facts.hang_watch:
        refused.append(
            (
                "distributed.timeout_s",
                "the hang watchdog writes no stacks: a rank that hangs would leave no trace "
                "of where it waited",
            )
        )
    return [f"{Guard.HANG_STACKS.value}({config.distributed.timeout_s:g} s)"], refused


def signal_rule(config: JobConfig, facts: GuardFacts) -> Verdict:
    refused = []
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
    armed = [Guard.SIGNALS.value + ("" if checkpointing else "(no checkpoint)")]
    if checkpointing:  # every commit records them; a resume fails closed without them
        armed.append(f"{Guard.CHECKSUMS.value}({config.checkpoint.verify.value})")
    return armed, refused


def float8_rule(config: JobConfig, facts: GuardFacts) -> Verdict:
    t, end = config.train, config.train.max_steps
    if t.float8_check <= 0:
        return [], []
    rule = Float8CheckRule(
        t.float8_check, t.float8_check_tolerance, t.float8_check_grad_tolerance, t.float8_on_drift
    )
    refused = []
    if facts.float8_check != rule or facts.float8_layers == 0:
        refused.append(
            ("train.float8_check", "is set, but the step compares no FP8 layer with high precision")
        )
    if rule.interval > end:
        refused.append(
            (
                "train.float8_check",
                f"checks every {rule.interval} steps, but the run ends at step {end} "
                f"(train.max_steps): no step of it is checked; set an interval of at most {end}",
            )
        )
    words = (
        f"{Guard.FLOAT8.value} every {rule.interval} ({percent(rule.tolerance)} loss, "
        f"{percent(rule.grad_tolerance)} grad norm: {rule.on_drift.value})"
    )
    return [words], refused


# every guard's rule, in the order of the start's line
GUARD_RULES: tuple[Callable[[JobConfig, GuardFacts], Verdict], ...] = (
    nonfinite_rule,
    spike_rule,
    replay_rule,
    straggler_rule,
    health_rule,
    hang_rule,
    signal_rule,
    float8_rule,
)


def guard_report(config: JobConfig, facts: GuardFacts) -> tuple[str, list[Problem]]:
    """The words of each armed guard, joined for the start's line, and the refusals of the
    guards the config turns on that cannot act here."""
    armed: list[str] = []
    refused: list[Problem] = []
    for rule in GUARD_RULES:
        words, problems = rule(config, facts)
        armed += words
        refused += problems
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


def operations_by_rank(
    per_rank: Sequence[Sequence[str]],
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each operation some rank's step runs without a deterministic kernel (``per_rank[r]``:
    rank ``r``'s, as the kernel probe names them), with the ranks that run it, by name."""
    ranks: dict[str, list[int]] = {}
    for rank, operations in enumerate(per_rank):
        for operation in operations:
            ranks.setdefault(operation, []).append(rank)
    return tuple((op, tuple(ranks[op])) for op in sorted(ranks))


def unverifiable_words(operations: Sequence[tuple[str, tuple[int, ...]]], world_size: int) -> str:
    """Why replays cannot act where the step runs ``operations`` without a deterministic
    kernel: each named, with the ranks that run it unless every rank does."""
    named = [
        op if len(ranks) == world_size else f"{op} (on {rank_span(ranks)})"
        for op, ranks in operations
    ]
    return (
        f"replays compare a step's computations bit for bit, but the step runs "
        f"{', '.join(named)} without a deterministic kernel: two computations may "
        "differ on healthy hardware, and a fault could not be told from noise; set "
        "resilience.replay_interval = 0 and resilience.replay_first_step = false "
        "(docs/resilience.md#replayed-steps)"
    )


def changed_key(res: ResilienceConfig, names: Sequence[str]) -> str | None:
    """The first of ``names`` (``[resilience]`` keys) that the config changes from its
    default to another value than its off value (``OFF_VALUES``), as a config spells it;
    None when it changes none."""
    for name in names:
        value = getattr(res, name)
        if value != getattr(DEFAULTS, name) and value != OFF_VALUES.get(name):
            return f"resilience.{name}"
    return None


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
