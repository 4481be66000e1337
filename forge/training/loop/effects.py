"""The real ``Effects``: checkpoints, records, eval and hooks, as the loop's plans ask.

Decisions are not made here (``plan_step`` and ``finalize`` made them); this only carries
them out, through the checkpoint effects (``checkpoint_effects``) and the step logger
(``step_logger``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from forge.checkpoint.costs import ResumeCost
from forge.metrics.sinks import JsonlSink, MetricsSink
from forge.training.context import DataContext, DistContext, ModelContext, RunContext
from forge.training.evaluation.downstream import DownstreamTasks
from forge.training.evaluation.evaluate import held_out_loss
from forge.training.loop.checkpoint_effects import CheckpointEffects
from forge.training.loop.hooks import HookList, Hooks
from forge.training.loop.plan import SaveReason
from forge.training.loop.step_logger import StepLogger
from forge.types import LoopOutcome, LoopState, StepResult


class TrainingEffects:
    """Saves, logs, evaluates and calls hooks for one training run."""

    def __init__(
        self,
        run: RunContext,
        dist: DistContext,
        model: ModelContext,
        data: DataContext,
        *,
        hooks: Sequence[Hooks] | HookList = (),
        sinks: Sequence[MetricsSink] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.run = run
        self.dist = dist
        self.model = model
        self.data = data
        self.hooks = hooks if isinstance(hooks, HookList) else HookList(hooks)
        self.logger = StepLogger(run, dist, data, sinks, clock)
        self.checkpoints = CheckpointEffects(run, dist, model, data, self.hooks)
        tasks = run.config.eval.tasks
        self.downstream = DownstreamTasks(run, dist, model) if tasks else None

    @property
    def log_failure(self) -> str | None:
        """Why records could not be written, if so."""
        return self.logger.log_failure

    def begin(self, state: LoopState, resume: ResumeCost | None = None) -> None:
        """Start timing and call ``on_train_begin``; what the resume cost (``resume``, this
        rank's) goes into the first logged record."""
        if resume is not None:
            self.logger.carry(resume.recorded())
        self.logger.restart_clock(state)
        self.hooks.on_train_begin(state)

    def save(self, state: LoopState, reason: SaveReason) -> None:
        """Start a save (``CheckpointEffects.save``); the steps after it are timed from its
        end."""
        started = self.checkpoints.save(state, reason)
        self.carry_save_costs()
        if started:
            self.logger.restart_clock(state)

    def wait(self) -> None:
        """Finish and commit the save in flight, if any."""
        self.checkpoints.wait()
        self.carry_save_costs()

    def save_status(self) -> tuple[bool, bool]:
        """Whether a save is in flight, and whether this rank has written it (the control
        word tells the loop when every rank has)."""
        return self.checkpoints.save_status()

    def committed_step(self) -> int | None:
        """The newest committed checkpoint's step (None: none known yet)."""
        return self.checkpoints.checkpointer.committed

    def carry_save_costs(self) -> None:
        """The latest committed save's costs, for the next logged record."""
        for cost in self.checkpoints.take_costs():
            self.logger.carry(cost.recorded())

    def log(self, state: LoopState, result: StepResult) -> None:
        """The step's record, its metrics reduced over ranks in one collective (every rank
        calls this)."""
        self.logger.log(state, result)

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
        emit = self.logger.emit
        emit({"step": state.step, "eval/loss": loss, "eval/perplexity": math.exp(loss)})
        if self.downstream is not None:  # [[eval.tasks]]: on every rank (they score in step)
            scores = self.downstream.scores(state.step)
            if scores:
                emit({"step": state.step, **scores})
        if loads is not None:  # a table, not a scalar: for metrics.jsonl only
            for sink in list(self.logger.sinks):  # write drops a sink that fails
                if isinstance(sink, JsonlSink):
                    self.logger.write(sink, {"step": state.step, "moe/layer_loads": loads})
        self.hooks.on_eval_end(state, loss)
        self.logger.restart_clock(state)

    def step_end(self, state: LoopState, result: StepResult) -> None:
        """Report a freeze transition, keep a mixture's sums for the next log, call
        ``on_step_end``."""
        self.logger.step_end(result)
        if result.freeze is not None:  # the trainable set changed before this step
            frozen = result.freeze
            self.logger.emit(
                {
                    "step": state.step,
                    "params/trainable": frozen.trainable,
                    "params/frozen": frozen.frozen,
                }
            )
        self.hooks.on_step_end(state, result)

    def snapshot(self, state: LoopState) -> None:
        """Refresh the in-memory rollback slot (model + optimizer, CPU clones)."""
        self.checkpoints.snapshot()

    def restore(self, state: LoopState) -> None:
        """Load the rollback slot taken at ``state`` back into the model and optimizer."""
        self.checkpoints.restore(state)

    def abandon(self) -> None:
        """After a fatal save failure: stop the checkpoint process and close the sinks,
        without waiting for anything."""
        self.checkpoints.abandon()
        self.logger.close()
        self.close_loaders()

    def outcome_after_saves(self, outcome: LoopOutcome) -> LoopOutcome:
        """``outcome``, or HEALTH_FAILURE when a save found a peer gone (its line printed)."""
        return self.checkpoints.outcome_after_saves(outcome)

    def end(self, outcome: LoopOutcome, state: LoopState) -> None:
        """Call ``on_train_end``, close the checkpointer, the sinks and the loaders' worker
        processes."""
        self.hooks.on_train_end(outcome, state)
        self.checkpoints.close()
        self.logger.close()
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
        return self.logger.cannot_log()
