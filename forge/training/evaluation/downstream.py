"""``[[eval.tasks]]``: lm-eval tasks scored on the live model at each evaluation, beside the
held-out loss. A task that fails warns once and is skipped from then on; the run goes on."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as torch_dist

from forge.config.data import EvalTask
from forge.errors import one_line
from forge.model.precision import autocast_for, device_type_of
from forge.optim.optimizers import evaluation_weights
from forge.parallel.context_parallel import whole_rows
from forge.training.context import DistContext, ModelContext, RunContext
from forge.training.evaluation.inference import run_tokenizer


def failure_line(task: EvalTask, step: int, exc: BaseException) -> str:
    """The one warning a failed task gives."""
    return (
        f"eval.tasks: {task.name!r} failed at step {step} and is skipped for the rest of "
        f"the run: {one_line(exc)}"
    )


class DownstreamTasks:
    """Scores the run's tasks through ``forge.harness`` whenever the loop evaluates: every
    data-parallel rank scores a share of the requests, all ranks in lockstep (FSDP's and
    TP's forwards are collectives), and every rank ends with the same scores. Context-
    parallel peers score their share over whole rows, the same on each (``whole_rows``)."""

    def __init__(self, run: RunContext, dist: DistContext, model: ModelContext) -> None:
        self.run = run
        self.dist = dist
        self.model = model
        self.tasks = run.config.eval.tasks
        self.failed: set[str] = set()
        self._lm: Any = None  # the backend and task index, built at the first evaluation
        self._manager: Any = None

    def backend(self) -> tuple[Any, Any]:
        """(the lm-eval model over this run's model, the task manager), built once."""
        if self._lm is None:
            from forge.harness.backend import ForgeLM, Scoring, local_only, over_ranks
            from forge.harness.requests import Share
            from forge.harness.tasks import include_paths, task_manager

            multi = self.dist.world_size > 1
            scoring = Scoring(
                self.run.config.eval.batch_size,
                Share(self.dist.dp_rank, self.dist.dp_size),
                lockstep=multi,
                multiple=self.dist.dims.tp,
                gather=over_ranks if multi else local_only,
                max_len=self.run.config.train.seq_len,
            )
            tok = run_tokenizer(self.run.config)
            self._lm = ForgeLM(self.model.model, tok, self.dist.device, scoring)
            self._manager = task_manager(include_paths(self.tasks), [t.name for t in self.tasks])
        return self._lm, self._manager

    def failed_anywhere(self, failed_here: bool) -> bool:
        """Whether a task failed on any rank (one tiny all-reduce): every rank then skips it,
        where one going on alone would wait for the others' forwards forever."""
        if self.dist.world_size == 1:
            return failed_here
        flag = torch.tensor([float(failed_here)], device=self.dist.device)
        torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
        return bool(flag.item())

    def scores(self, step: int) -> dict[str, float]:
        """``eval/<task>/<metric>`` of every task that has not failed, under the optimizer's
        evaluation weights and the run's precision. A task that fails to load (on any rank:
        they agree before scoring) is warned about on rank 0, once, and skipped from then
        on; one rank alone failing while scoring, where its peers wait in a forward, cannot
        be agreed on: the error ends the run."""
        out: dict[str, float] = {}
        module = self.model.model
        was_training = module.training
        autocast = autocast_for(self.run.config.train.mixed_precision, device_type_of(module))
        from forge.harness.tasks import random_state_kept

        try:  # loading a task draws too (datasets' fingerprints): every draw is undone
            # CP peers share a data-parallel rank, so they score the same share, whole rows
            with (
                random_state_kept(),
                evaluation_weights(self.model.optimizer),
                autocast(),
                whole_rows(module),
            ):
                module.eval()
                for task in self.tasks:
                    if task.name not in self.failed:
                        out |= self.task_scores(task, step)
        finally:
            module.train(was_training)
        return out

    def task_scores(self, task: EvalTask, step: int) -> dict[str, float]:
        """One task's scores (none if it fails): loaded on every rank, agreed, then scored."""
        from forge.harness.requests import flat_metrics
        from forge.harness.tasks import load_tasks, score_tasks

        lm, loaded, error = None, None, None
        try:
            lm, manager = self.backend()
            loaded = load_tasks(manager, [task.name])
        except Exception as exc:  # a task's error is a warning, never the run's end
            error = exc
        if self.failed_anywhere(error is not None) or loaded is None or lm is None:
            return self.skip(task, step, error)
        try:
            results = score_tasks(lm, loaded, task.limit, 0)
        except Exception as exc:
            if self.dist.world_size > 1:  # peers may be inside a collective: no agreement
                raise
            return self.skip(task, step, exc)
        return flat_metrics(results.get("results", {}))

    def skip(self, task: EvalTask, step: int, error: BaseException | None) -> dict[str, float]:
        """Mark ``task`` failed and say so on rank 0 (its own error, or another rank's)."""
        self.failed.add(task.name)
        if self.dist.is_main:
            cause = error if error is not None else RuntimeError("it failed on another rank")
            print(f"[forge] warning: {failure_line(task, step, cause)}", file=sys.stderr)
        return {}
