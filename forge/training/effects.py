"""The real ``Effects``: checkpoints, metrics, eval and hooks, as the loop's plans ask.

Decisions are not made here (``plan_step`` and ``finalize`` made them); this only carries them out.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from forge.checkpoint.async_staging import stop_checkpoint_process
from forge.checkpoint.checkpointer import Checkpointer
from forge.checkpoint.export import export_model, tokenizer_info
from forge.checkpoint.slots import Slots
from forge.checkpoint.store import apply_retention
from forge.config.loader import CONVERTER
from forge.config.sections import AsyncMode
from forge.errors import CheckpointSaveError
from forge.metrics.backends import TensorBoardSink, WandbSink
from forge.metrics.flops import (
    PeakFlops,
    PeakSource,
    device_name,
    device_peak,
    flops_per_token,
    peak_line,
    raise_cpu_peak,
    throughput,
    under_measured_line,
)
from forge.metrics.memory import memory_record
from forge.metrics.moe import moe_record
from forge.metrics.sinks import JsonlSink, MetricsSink, console_sink, sink_failure, step_record
from forge.metrics.sources import row_record, source_record
from forge.optim.optimizers import evaluation_weights
from forge.parallel.reduce import mean_over_ranks, sum_over_ranks
from forge.training.context import DataContext, DistContext, ModelContext, RunContext
from forge.training.downstream import DownstreamTasks
from forge.training.evaluate import held_out_loss
from forge.training.hooks import HookList, Hooks
from forge.training.plan import SaveReason, save_failure_is_fatal
from forge.training.run_record import current_settings, run_identity
from forge.training.train_state import (
    TRAIN_STATE_VERSION,
    LoaderRecord,
    ScheduleRecord,
    TrainState,
    train_state_to_json,
)
from forge.types import LoopOutcome, LoopState, SourceTotals, StepResult, stats_from_flat

ROLLBACK_SLOT = "rollback"


class TrainingEffects:
    """Saves, logs, evaluates and calls hooks for one training run."""

    def __init__(
        self,
        run: RunContext,
        dist: DistContext,
        model: ModelContext,
        data: DataContext,
        *,
        hooks: Sequence[Hooks] = (),
        sinks: Sequence[MetricsSink] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.run = run
        self.dist = dist
        self.model = model
        self.data = data
        self.hooks = HookList(hooks)
        self.clock = clock
        if sinks is None:
            sinks = default_sinks(run, dist)
        self.sinks = list(sinks)
        self.log_failure: str | None = None  # why records could not be written, if so
        self._mark_time = clock()
        self._mark_step = 0
        self._flops_per_token = flops_per_token(run.config.model, run.config.train.seq_len)
        self._peak: tuple[PeakFlops | None] | None = None  # (peak,) after the first log
        self._peak_warned = False  # an MFU clamped at 1 is reported once
        self._schedule = run.policy.schedule
        self._sources: SourceTotals | None = None  # a mixture's sums since the last log
        self._logged: StepResult | None = None  # the step whose sums the last log took
        self.slots = Slots(model.model, model.optimizer)
        tasks = run.config.eval.tasks
        self.downstream = DownstreamTasks(run, dist, model) if tasks else None
        self._save_reasons: dict[int, SaveReason] = {}
        self.checkpointer = Checkpointer(
            run.checkpoint_dir,
            run.config.checkpoint.async_mode,
            dist.rank,
            dist.world_size,
            on_commit=self._committed,
            daemon_log=run.run_dir / f"checkpoint_process_rank{dist.rank}.log",
        )

    def _restart_clock(self, state: LoopState) -> None:
        self._mark_time, self._mark_step = self.clock(), state.step

    def begin(self, state: LoopState) -> None:
        """Start timing and call ``on_train_begin``."""
        self._restart_clock(state)
        self.hooks.on_train_begin(state)

    def train_state(self, state: LoopState, reason: SaveReason) -> dict[str, Any]:
        """The JSON train state saved beside the tensors."""
        loader = self.data.train_loader.state_dict()  # the same position on every rank
        schedule = self.model.schedule
        return train_state_to_json(
            TrainState(
                format_version=TRAIN_STATE_VERSION,
                step=state.step,
                tokens_seen=state.tokens_seen,
                reason=reason,
                loop_state=state,
                loader=CONVERTER.structure(loader, LoaderRecord),
                schedule=ScheduleRecord(
                    schedule.name.value,
                    schedule.warmup_steps,
                    schedule.decay_steps,
                    schedule.total_steps,
                ),
                world_size=self.dist.world_size,
                identity=run_identity(self.run.config, self.dist.dp_size, self.data.fingerprints),
                settings=current_settings(self.run.config, self.model.peak_lr, self.model.schedule),
            )
        )

    def save(self, state: LoopState, reason: SaveReason) -> None:
        """Start a save (it commits in ``wait``, at once in synchronous mode). A failed save
        is reported and training goes on, unless ``save_failure_is_fatal`` says otherwise:
        then ``CheckpointSaveError`` ends the run."""
        self.wait()  # an earlier save's failure is handled before this one starts
        saved = attrs.evolve(state, last_saved_step=state.step)
        self._save_reasons[state.step] = reason
        try:
            self.checkpointer.save(
                state.step, self.model.model, self.model.optimizer, self.train_state(saved, reason)
            )
        except CheckpointSaveError as exc:
            self._save_failed(exc)
            return
        if reason is SaveReason.FINAL and self.run.config.checkpoint.export_final:
            self.export()
        self._restart_clock(state)

    def _committed(self, step: int, path: pathlib.Path) -> None:
        """Rank 0, after a commit: retention, then ``on_checkpoint_save``."""
        if self._schedule is not None:
            keep = self.run.config.checkpoint.keep_last_n
            apply_retention(self.run.checkpoint_dir, keep, self._schedule)
        self.hooks.on_checkpoint_save(step, path)

    def export(self) -> None:
        """Write ``<run.dir>/export``: the full model in Llama safetensors layout (rank 0)."""
        with evaluation_weights(self.model.optimizer):  # Schedule-Free: the averaged weights
            full = get_model_state_dict(
                self.model.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if self.dist.is_main:
            ck = self.run.config.checkpoint
            tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
            export_model(
                tensors,
                self.run.config.model,
                self.run.export_dir,
                ck.export_dtype.value,
                tokenizer_info(self.data.manifest.tokenizer),
            )

    def wait(self) -> None:
        """Finish and commit the save in flight, if any."""
        try:
            self.checkpointer.wait()
        except CheckpointSaveError as exc:
            self._save_failed(exc)

    def _save_failed(self, exc: CheckpointSaveError) -> None:
        reason = self._save_reasons.pop(exc.step, SaveReason.SCHEDULED)
        if save_failure_is_fatal(reason, exc.step, self.run.config.train.max_steps):
            raise exc
        if self.dist.is_main:
            print(f"[forge] warning: {exc}; training goes on", file=sys.stderr, flush=True)

    def abandon(self) -> None:
        """After a fatal save failure: stop the checkpoint process and close the sinks,
        without waiting for anything."""
        if self.run.config.checkpoint.async_mode is AsyncMode.ASYNC_PROCESS:
            stop_checkpoint_process()
        self.checkpointer.stager.close()
        self.checkpointer.stop_threads()
        for sink in self.sinks:
            sink.close()
        self.close_loaders()

    def _sources_since_log(self, result: StepResult) -> SourceTotals | None:
        """A mixture's per-source sums over the steps since the last log, this one included
        (``step_end`` adds the steps that are not logged)."""
        totals = add_sources(self._sources, result.sources)
        self._sources, self._logged = None, result
        return totals

    def log(self, state: LoopState, result: StepResult) -> None:
        """Every rank calls this (a logging step is decided the same everywhere): the loss is
        averaged over data-parallel ranks here, so that no other step pays for the reduction."""
        sources = self._sources_since_log(result)  # before ``result`` is replaced below
        if result.z_loss is None:
            loss = mean_over_ranks(result.loss, self.dist.world_size, self.dist.device)
            result = attrs.evolve(result, loss=loss)
        else:  # both in one reduction
            loss, z = sum_over_ranks(
                [result.loss, result.z_loss], self.dist.world_size, self.dist.device
            )
            world = self.dist.world_size
            result = attrs.evolve(result, loss=loss / world, z_loss=z / world)
        elapsed = self.clock() - self._mark_time
        steps = max(1, state.step - self._mark_step)
        step_time = elapsed / steps
        tps = result.tokens / step_time if step_time > 0 else math.inf
        record = step_record(state, result, step_time, tps)
        record |= row_record(self.data.train_loader.state_dict())
        if self.dist.is_main:  # only rank 0 writes metrics: the others skip the measurement
            record |= self._throughput(tps)
            record |= memory_record(self.dist.device)
        if result.moe is not None:  # every rank holds its own statistics: summed here
            moe = result.moe
            total = sum_over_ranks(moe.flat(), self.dist.world_size, self.dist.device)
            summed = stats_from_flat(total, len(moe.loads), len(moe.loads[0]))
            record |= moe_record(summed, self.dist.world_size)
        if sources is not None:
            record |= source_record(self.data.source_names, self._source_sums(sources))
        self._emit(record)
        self._restart_clock(state)

    def _source_sums(self, sources: SourceTotals) -> list[list[float]]:
        """A mixture's loss sums and token counts over every data slice: the sum over the
        world counts each slice once per rank that holds it (tensor-parallel peers), so both
        are scaled back to one count per slice."""
        sums = sum_over_ranks(sources.flat(), self.dist.world_size, self.dist.device)
        scale = self.dist.token_slices / self.dist.world_size
        n = len(sources.loss)
        return [[v * scale for v in sums[:n]], [v * scale for v in sums[n:]]]

    def _throughput(self, tokens_per_sec: float) -> dict[str, float]:
        """Rank 0's throughput metrics. The peak is looked up (on a CPU: read from the cache
        or measured) at the first log, which says where it came from; an MFU clamped at 1 is
        reported once."""
        if self._peak is None:
            peak = device_peak(self.dist.device, self.run.config.train.mixed_precision)
            self._peak = (peak,)
            line = peak_line(peak, device_name(self.dist.device))
            print(f"[forge] {line}", file=sys.stderr, flush=True)
        peak = self._peak[0]
        flops = None if peak is None else peak.flops
        result = throughput(tokens_per_sec, self.dist.world_size, self._flops_per_token, flops)
        clamped = result.mfu is not None and result.mfu.under_measured
        if peak is not None and clamped and not self._peak_warned:
            self._peak_warned = True
            warning = under_measured_line(peak, result.achieved)
            print(f"[forge] warning: {warning}", file=sys.stderr, flush=True)
            if peak.source is not PeakSource.DATASHEET:  # a CPU's: later runs start from it
                raise_cpu_peak(self.run.config.train.mixed_precision, result.achieved)
        return result.record()

    def evaluate(self, state: LoopState) -> None:
        loader = self.data.eval_loader
        if loader is None:
            return
        loader.rewind()
        steps = self.run.config.eval.steps
        batches = [b for _, b in zip(range(steps), loader, strict=False)]
        train = self.run.config.train
        loss, loads = held_out_loss(
            self.model, self.dist, batches, train.mixed_precision, train.grad_accum_steps
        )
        self._emit({"step": state.step, "eval/loss": loss, "eval/perplexity": math.exp(loss)})
        if self.downstream is not None:  # [[eval.tasks]]: on every rank (they score in step)
            scores = self.downstream.scores(state.step)
            if scores:
                self._emit({"step": state.step, **scores})
        if loads is not None:  # a table, not a scalar: for metrics.jsonl only
            for sink in list(self.sinks):  # _write drops a sink that fails
                if isinstance(sink, JsonlSink):
                    self._write(sink, {"step": state.step, "moe/layer_loads": loads})
        self.hooks.on_eval_end(state, loss)
        self._restart_clock(state)

    def step_end(self, state: LoopState, result: StepResult) -> None:
        """Report a freeze transition, keep a mixture's sums for the next log, call
        ``on_step_end``."""
        if result is not self._logged:
            self._sources = add_sources(self._sources, result.sources)
        if result.freeze is not None:  # the trainable set changed before this step
            frozen = result.freeze
            self._emit(
                {
                    "step": state.step,
                    "params/trainable": frozen.trainable,
                    "params/frozen": frozen.frozen,
                }
            )
        self.hooks.on_step_end(state, result)

    def snapshot(self, state: LoopState) -> None:
        """Refresh the in-memory rollback slot (model + optimizer, CPU clones)."""
        self.slots.push(ROLLBACK_SLOT)

    def restore(self, state: LoopState) -> None:
        """Load the rollback slot taken at ``state`` back into the model and optimizer."""
        freezer = self.model.freezer
        if freezer is not None:  # the optimizer's parameters as at the snapshot
            step = max(1, state.step)
            freezer.hold(freezer.trainable_at(step), step)
        self.slots.load(ROLLBACK_SLOT)
        if self.dist.is_main:
            print(f"[forge] non-finite step: rolled back to step {state.step}", file=sys.stderr)

    def end(self, outcome: LoopOutcome, state: LoopState) -> None:
        """Call ``on_train_end``, close the checkpointer, the sinks and the loaders' worker
        processes."""
        self.hooks.on_train_end(outcome, state)
        self.checkpointer.close()
        for sink in self.sinks:
            sink.close()
        self.close_loaders()

    def close_loaders(self) -> None:
        """Stop the loaders' worker processes now, not when the garbage collector reaches
        them (in a notebook or a test process, that was during the next run's save, and
        each worker's exit then waited out a 5 s timeout)."""
        self.data.train_loader.close()
        if self.data.eval_loader is not None:
            self.data.eval_loader.close()

    def cannot_log(self) -> bool:
        """Whether a metrics file could not be written: the run should stop (with a
        checkpoint) rather than train on without its records."""
        return self.log_failure is not None

    def _emit(self, record: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            self._write(sink, record)

    def _write(self, sink: MetricsSink, record: Mapping[str, Any]) -> None:
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


def add_sources(a: SourceTotals | None, b: SourceTotals | None) -> SourceTotals | None:
    """``a + b``, where None is nothing."""
    if a is None or b is None:
        return a if b is None else b
    return a + b


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
