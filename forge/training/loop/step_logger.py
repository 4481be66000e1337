"""The records a run writes: each logged step's metrics, reduced over ranks in one
collective, its throughput, and the sinks they go to (a sink that fails is dropped, and a
file's failure stops the run with a checkpoint)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from forge.config.resilience import ResilienceConfig
from forge.metrics.backends import TensorBoardSink, WandbSink
from forge.metrics.flops import flops_per_token
from forge.metrics.memory import memory_record
from forge.metrics.mfu import MfuMeter
from forge.metrics.moe import moe_metrics
from forge.metrics.reduction import Recorded, Reduction, recorded_value
from forge.metrics.sinks import JsonlSink, MetricsSink, console_sink, sink_failure, step_record
from forge.metrics.sources import row_record, source_metrics
from forge.parallel.reduce import reduce_metrics
from forge.resilience.stragglers import (
    StragglerStreak,
    next_streak,
    straggler_line,
    straggler_reading,
    warns,
)
from forge.training.context import DataContext, DistContext, RunContext
from forge.types import LoopState, ReplicaStep, SourceTotals, StepResult

BUSY = "straggler/busy_s"  # each rank's own time per step, gathered (not logged as such)


def step_metrics(
    result: StepResult, sources: SourceTotals | None, source_names: Sequence[str]
) -> list[Recorded]:
    """What a logged step reduces over ranks: the loss (and z-loss), a mixture of experts'
    statistics, a data mixture's per-source sums since the last log."""
    metrics = [recorded_value("loss", result.loss, Reduction.MEAN)]
    if result.z_loss is not None:
        metrics.append(recorded_value("z_loss", result.z_loss, Reduction.MEAN))
    for k, value in enumerate(result.mtp or (), start=1):  # each depth's, beside the main loss
        metrics.append(recorded_value(f"mtp/loss_{k}", value, Reduction.MEAN))
    if result.float8 is not None:  # a step checked against high precision (agreed)
        metrics.append(recorded_value("float8/loss_drift", result.float8.loss_drift, Reduction.MAX))
        drift = result.float8.grad_norm_drift
        metrics.append(recorded_value("float8/grad_norm_drift", drift, Reduction.MAX))
    if result.moe is not None:
        metrics += moe_metrics(result.moe)
    if sources is not None:
        metrics += source_metrics(source_names, sources)
    return metrics


def resilience_record(state: LoopState, config: ResilienceConfig) -> dict[str, int]:
    """The run's counts of spikes and of replayed steps that disagreed, where their checks
    are on (or, for the replays, once one has disagreed), and of non-finite steps once one
    was."""
    record = {}
    if state.nonfinite_steps:
        record["resilience/nonfinite_steps"] = state.nonfinite_steps
    if config.spike_threshold > 0:
        record["resilience/spikes"] = state.spikes
    if config.replay_interval > 0 or state.replay_mismatches:
        record["resilience/replay_mismatches"] = state.replay_mismatches
    return record


def replica_record(replicas: ReplicaStep | None) -> dict[str, Any]:
    """Under ``[fault_tolerance]``: the replica groups that took part in the steps since the
    last log (the fewest), the attempts that did not commit, and a heal's seconds
    (``replicas_since``; the same on every rank of a group)."""
    if replicas is None:
        return {}
    record: dict[str, Any] = {
        "ft/participants": replicas.participants,
        "ft/failed_attempts": replicas.failed_attempts,
    }
    if replicas.heal_s > 0:
        record["ft/heal_s"] = replicas.heal_s
    return record


def replicas_since(a: ReplicaStep | None, b: ReplicaStep | None) -> ReplicaStep | None:
    """Two steps' ``ReplicaStep`` taken together, for the log that covers both: the fewest
    groups that took part in either, their failed attempts and heal seconds summed (a step of
    one group between two logs is not hidden by the logged step's two); None is nothing."""
    if a is None or b is None:
        return a if b is None else b
    return ReplicaStep(
        participants=min(a.participants, b.participants),
        failed_attempts=a.failed_attempts + b.failed_attempts,
        heal_s=a.heal_s + b.heal_s,
    )


def add_sources(a: SourceTotals | None, b: SourceTotals | None) -> SourceTotals | None:
    """``a + b``, where None is nothing."""
    if a is None or b is None:
        return a if b is None else b
    return a + b


class StepLogger:
    """Times the steps between logs, builds each logged record and writes it."""

    def __init__(
        self,
        run: RunContext,
        dist: DistContext,
        data: DataContext,
        sinks: Sequence[MetricsSink] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.dist = dist
        self.data = data
        self.clock = clock
        self.sinks = list(default_sinks(run, dist) if sinks is None else sinks)
        self.log_failure: str | None = None  # why records could not be written, if so
        self.meter = MfuMeter(
            dist.device,
            run.config.train.mixed_precision,
            dist.world_size,
            flops_per_token(run.config.model, run.config.train.seq_len),
        )
        self._mark_time = clock()
        self._mark_step = 0
        self._sources: SourceTotals | None = None  # a mixture's sums since the last log
        self._replicas: ReplicaStep | None = None  # the replica groups' steps since the last log
        self._logged: StepResult | None = None  # the step whose sums the last log took
        self._busy = (0.0, 0)  # this rank's own time since the last log, and its steps
        self.resilience = run.config.resilience
        self.streak = StragglerStreak()
        self._carried: dict[str, Recorded] = {}  # for the next logged record
        self._measured: dict[str, Any] = {}  # rank 0's own, for the next logged record

    def carry(self, metrics: Sequence[Recorded]) -> None:
        """Metrics (every rank the same, at the same steps) the next logged record reduces
        with its own, in its one collective; a later one of a name replaces one not yet
        logged."""
        self._carried |= {m.name: m for m in metrics}

    def measured(self, values: Mapping[str, Any]) -> None:
        """Values rank 0 measured alone (the goodput ledger), for the next logged record: no
        reduction, no collective."""
        self._measured = dict(values)

    def restart_clock(self, state: LoopState) -> None:
        """Time the next steps from now (after a save, an eval or the start)."""
        self._mark_time, self._mark_step = self.clock(), state.step

    def log(self, state: LoopState, result: StepResult) -> None:
        """Every rank calls this (a logging step is decided the same everywhere): the step's
        metrics are reduced over ranks here, in one collective, so that no other step pays
        for a reduction."""
        sources = add_sources(self._sources, result.sources)
        replicas = replicas_since(self._replicas, result.replicas)
        busy, steps = self._busy[0] + result.busy_s, self._busy[1] + 1
        self._sources, self._logged, self._busy = None, result, (0.0, 0)
        self._replicas = None
        metrics = step_metrics(result, sources, self.data.source_names)
        world, rank = self.dist.world_size, self.dist.rank
        stragglers = world > 1 and self.dist.device.type == "cpu"  # docs/resilience.md
        if stragglers:  # every rank's own time per step, gathered in the same collective
            metrics.append(recorded_value(BUSY, busy / steps, Reduction.GATHER))
        metrics += [self._carried[name] for name in sorted(self._carried)]
        self._carried = {}
        reduced = reduce_metrics(metrics, world, rank, self.dist.token_slices, self.dist.device)
        loss, z_loss = reduced.pop("loss"), reduced.pop("z_loss", None)
        if stragglers:
            reduced |= self.stragglers(reduced.pop(BUSY))
        reduced |= resilience_record(state, self.resilience)
        reduced |= replica_record(replicas)
        result = attrs.evolve(result, loss=loss, z_loss=z_loss)
        step_time = (self.clock() - self._mark_time) / max(1, state.step - self._mark_step)
        tps = result.tokens / step_time if step_time > 0 else math.inf
        record = step_record(state, result, step_time, tps)
        record |= row_record(self.data.train_loader.state_dict())
        if self.dist.is_main:  # only rank 0 writes metrics: the others skip the measurement
            record |= self.meter.record(tps)
            record |= memory_record(self.dist.device)
            record |= self._measured
        self._measured = {}
        self.emit(record | reduced)
        self.restart_clock(state)

    def step_end(self, result: StepResult) -> None:
        """Keep a mixture's sums and this rank's own time of a step the log did not take, for
        the next log."""
        if result is not self._logged:
            self._sources = add_sources(self._sources, result.sources)
            self._replicas = replicas_since(self._replicas, result.replicas)
            self._busy = (self._busy[0] + result.busy_s, self._busy[1] + 1)

    def stragglers(self, busy: Sequence[float]) -> dict[str, Any]:
        """The straggler metrics of every rank's own time per step, and the warning (rank 0)
        when one rank has stayed slow for ``resilience.straggler_logs`` logs."""
        reading = straggler_reading(busy)
        self.streak = next_streak(self.streak, reading, self.resilience.straggler_ratio)
        logs = self.resilience.straggler_logs
        if warns(self.streak, logs) and self.dist.is_main:
            host = self.dist.host(reading.slowest_rank)
            print(f"[forge] warning: {straggler_line(reading, host, logs)}", file=sys.stderr)
        return {"straggler/slowest_rank": reading.slowest_rank, "straggler/ratio": reading.ratio}

    def cannot_log(self) -> bool:
        """Whether a metrics file could not be written: the run should stop (with a
        checkpoint) rather than train on without its records."""
        return self.log_failure is not None

    def emit(self, record: Mapping[str, Any]) -> None:
        """``record`` to every sink."""
        for sink in list(self.sinks):  # write drops a sink that fails
            self.write(sink, record)

    def write(self, sink: MetricsSink, record: Mapping[str, Any]) -> None:
        """One record to one sink; a sink that cannot write (a full disk, a file-size limit,
        a closed console) is dropped, and a file's failure is kept for ``cannot_log``."""
        try:
            sink.write(record)
        except OSError as exc:
            self.sinks.remove(sink)
            with contextlib.suppress(OSError):
                sink.close()
            step = int(record.get("step", 0))
            self.log_failure = self.log_failure or sink_failure(sink, exc, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def default_sinks(run: RunContext, dist: DistContext) -> list[MetricsSink]:
    """The console, ``metrics.jsonl`` and the enabled TensorBoard / W&B sinks on rank 0;
    nothing elsewhere."""
    if not dist.is_main:
        return []
    sinks: list[MetricsSink] = [console_sink(sys.stdout, run.config.train.max_steps)]
    metrics = run.config.metrics
    if metrics.jsonl:
        sinks.append(JsonlSink(run.metrics_path))
    if metrics.tensorboard:
        sinks.append(TensorBoardSink(run.run_dir / "tensorboard"))
    if metrics.wandb:
        sinks.append(WandbSink(run.config, run.run_dir))
    return sinks
