"""The effects of ``scripts/eval_follow.py``: looking at a run, and evaluating one of its
checkpoints the way in-loop evaluation does (``follow`` decides which).

The held-out loss is in-loop evaluation's, on the same rows: the trainer's data-parallel ranks
each evaluate ``eval.steps`` batches of the held-out order of their rank, so the follower takes
exactly those rows (for the data-parallel size the checkpoint was saved at), shares them out
over its own ranks and sums, as the trainer's ranks do. Tasks are scored as ``[[eval.tasks]]``
are in the loop: each loaded afresh, on its ``limit``, with ``eval.batch_size`` requests a
forward, no standard errors, under the optimizer's evaluation weights and the run's precision.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.pins import RETIRING, finish_deferred, has_marker, pinned
from forge.checkpoint.store import is_complete, list_steps, read_train_state
from forge.config.data import EvalTask
from forge.config.sections import JobConfig
from forge.data.batch import Batch
from forge.data.dataset import open_windows
from forge.data.image_text import open_image_captions
from forge.data.loader import TextLoader
from forge.data.shards import DataError, Manifest, read_manifest
from forge.errors import one_line
from forge.model.chunked_loss import loss_spec_of
from forge.model.precision import autocast_for, device_type_of
from forge.optim.optimizers import evaluation_weights
from forge.parallel.world import resolve_dims
from forge.training.evaluation.evaluate import evaluate_totals, totals_over_ranks
from forge.training.evaluation.follow import (
    LOSS,
    FollowView,
    done_pairs,
    json_lines,
    loss_record,
    recorded_steps,
    rewinds_of,
    task_record,
)
from forge.training.evaluation.inference import LoadedModel, NamedCheckpointError, run_tokenizer
from forge.training.records.run_dir import trainer_running
from forge.training.records.run_records import COMMITS_FILE
from forge.training.setup.loaders import held_out_sampling


@attrs.frozen
class FollowOptions:
    """How the follower runs: which steps (``every``), which tasks, how often it looks
    (``poll_s``), how long a pin of its lasts unrenewed (``pin_ttl_s``), its pin's name."""

    every: int
    tasks: tuple[EvalTask, ...]
    poll_s: float
    pin_ttl_s: float
    holder: str


def look(run_dir: pathlib.Path, root: CheckpointPath, config: JobConfig, records) -> FollowView:
    """One look at the run: its complete checkpoints, its record of commits, the follower's
    records (``records``, already read) and the step it completes at. The record of commits
    is read before the checkpoints are listed: a step is recorded only once committed, so a
    commit landing between the two reads is seen complete, never recorded and missing."""
    commits = json_lines(run_dir / COMMITS_FILE)
    steps = list_steps(root)
    committed = frozenset(s for s in steps if is_complete(root / f"step_{s}"))
    done = done_pairs(records, rewinds_of(commits))
    recorded, final = recorded_steps(commits), config.train.max_steps
    # committed once and not complete now: gone, or there and damaged (looked at only for
    # the steps without a record yet: a long run's removed steps cost no call each time)
    recorded_steps_done = {s for s, _ in done}
    unsure = recorded - committed - recorded_steps_done
    incomplete = frozenset(s for s in unsure if damaged(root, s))
    running = trainer_running(run_dir)
    return FollowView(committed, recorded, done, final, running, incomplete)


def damaged(root: CheckpointPath, step: int) -> bool:
    """Whether a committed step found not complete is still there and damaged, not being
    removed: retention marks a step retiring before it takes its commit marker, and takes the
    mark back only once the folder is gone, so the mark is read first, then the folder."""
    return not has_marker(root, step, RETIRING) and (root / f"step_{step}").is_dir()


def trainer_dp(config: JobConfig, checkpoint: CheckpointPath) -> int:
    """The data-parallel size the checkpoint was saved at (its train state's world size under
    the run's layout): the held-out rows in-loop evaluation read at that step depend on it."""
    world = read_train_state(checkpoint).get("world_size", 1)
    return resolve_dims(config.distributed, int(world) if isinstance(world, int) else 1).dp


def held_out_problem(config: JobConfig) -> str | None:
    """Why the follower cannot compute the held-out loss of this run: its data folder or the
    held-out split is gone, or holds fewer examples than one batch (the check in-loop
    evaluation makes at start-up)."""
    folder = pathlib.Path(config.data.source_list[0].path)
    split = config.data.eval_split
    try:
        manifest = read_manifest(folder)
        if split not in manifest.splits:
            return f"{folder}: no split {split!r} to evaluate on; pass --no-loss for tasks only"
        held = open_held_out(config, folder, manifest)
    except DataError as exc:
        return f"{exc}; restore the run's data (or pass --no-loss for tasks only)"
    if len(held) < config.train.batch_size:
        return (
            f"{folder}: split {split!r} has {len(held)} examples, fewer than one batch "
            f"({config.train.batch_size}); pass --no-loss for tasks only"
        )
    return None


def open_held_out(config: JobConfig, folder: pathlib.Path, manifest: Manifest):
    """The held-out split's examples: windows of a text run, image–caption pairs of a VLM."""
    data, seq_len = config.data, config.train.seq_len
    if config.model.vlm is not None:
        return open_image_captions(folder, manifest, data.eval_split, seq_len, True)
    return open_windows(folder, manifest, data.eval_split, seq_len, True)


def held_out_batches(
    config: JobConfig, dp: int, rank: int, world: int, device: torch.device
) -> list[Batch]:
    """This follower rank's share of the rows in-loop evaluation reads at data-parallel size
    ``dp``: trainer rank ``r``'s ``eval.steps`` batches for every ``r`` this rank takes
    (``r % world == rank``). A pipeline evaluates whole groups of ``grad_accum_steps``
    batches only, so the follower leaves out what it leaves out."""
    data = config.data
    folder = pathlib.Path(data.source_list[0].path)
    manifest = read_manifest(folder)
    held = open_held_out(config, folder, manifest)
    text = config.model.vlm is None
    bos_id = int(manifest.tokenizer["bos_id"]) if text and data.pack_documents else None
    steps = config.eval.steps
    if config.distributed.pp > 1:
        per = config.train.grad_accum_steps
        steps = steps // per * per
    out: list[Batch] = []
    for r in range(rank, dp, world):
        sampling = held_out_sampling(config, len(held), r, dp)
        sources = held if config.model.vlm is not None else [held]
        loader = TextLoader(sources, sampling, bos_id=bos_id, device=device)  # type: ignore[arg-type]
        try:
            out += [b for _, b in zip(range(steps), loader, strict=False)]
        finally:
            loader.close()
    return out


def held_out_loss_of(
    loaded: LoadedModel, config: JobConfig, batches: list[Batch], world: int
) -> tuple[float, int]:
    """(mean held-out loss, labels) over every follower rank's ``batches``."""
    with evaluation_weights(loaded.optimizer):
        totals = evaluate_totals(
            loaded.model, batches, config.train.mixed_precision, loss_spec_of(config)
        )
    summed = totals_over_ranks(attrs.evolve(totals, moe_loads=None), world, loaded.device)
    return summed.mean, summed.count


def task_scores(
    loaded: LoadedModel, config: JobConfig, task: EvalTask, rank: int, world: int
) -> dict[str, float]:
    """One task's ``eval/<task>/<metric>`` scores, as the loop's ``DownstreamTasks`` takes
    them."""
    from forge.harness.backend import ForgeLM, Scoring, local_only, over_ranks
    from forge.harness.requests import Share, flat_metrics
    from forge.harness.tasks import include_paths, load_tasks, score_tasks, task_manager

    scoring = Scoring(
        config.eval.batch_size,
        Share(rank, world),
        gather=over_ranks if world > 1 else local_only,
        max_len=config.train.seq_len,
    )
    lm = ForgeLM(loaded.model, run_tokenizer(config), loaded.device, scoring)
    manager = task_manager(include_paths([task]), [task.name])
    module = loaded.model
    autocast = autocast_for(config.train.mixed_precision, device_type_of(module))
    module.eval()
    with evaluation_weights(loaded.optimizer), autocast():
        results = score_tasks(lm, load_tasks(manager, [task.name]), task.limit, 0)
    return flat_metrics(results.get("results", {}))


READABLE, GONE = "readable", "gone"


def pinned_state(acquired: bool, path: CheckpointPath) -> str:
    """What a pinned step is: readable, gone (retention was removing it, or it is not there),
    or why it cannot be read (there, but not complete)."""
    if not acquired:
        return GONE
    if is_complete(path):
        return READABLE
    if path.is_dir():
        return f"{path} is incomplete (no commit marker: .metadata or train_state.json missing)"
    return GONE


@attrs.frozen
class Evaluated:
    """A step's new records (rank 0's to write) or why it could not be read."""

    records: list[dict]
    unreadable: str | None = None


def evaluate_step(
    step: int,
    missing: tuple[str, ...],
    root: CheckpointPath,
    options: FollowOptions,
    load: Callable[[CheckpointPath], LoadedModel],
    config: JobConfig,
    rank: int,
    world: int,
    sync: Callable[[Any], Any],
) -> Evaluated | None:
    """Pin step ``step``, load it (``load``: every rank), unpin, then evaluate what it
    ``missing``. None when retention was already removing it or it is gone; unreadable when
    it is there but incomplete (every rank agrees through ``sync``, which returns rank 0's
    value)."""
    broadcast_state = sync
    path = root / f"step_{step}"
    clock = time.time
    with pinned(root, step, options.holder, options.pin_ttl_s, clock) as acquired:
        # the pin is written first: a step still complete now stays so until it is released
        state = pinned_state(acquired, path) if rank == 0 else ""
        state = broadcast_state(state)
        if state == GONE:
            return None
        if state != READABLE:
            return Evaluated([], state)
        try:
            loaded, dp, problem = load(path), trainer_dp(config, path), None
        except NamedCheckpointError as exc:  # damaged: recorded, not the follower's end
            loaded, dp, problem = None, 1, exc.why
        except Exception as exc:
            loaded, dp, problem = None, 1, one_line(exc)
        sync(True)  # every rank has read it before rank 0 unpins
    if rank == 0:
        finish_deferred(root, step, clock())
    if loaded is None:
        return Evaluated([], problem)
    records: list[dict] = []
    label = str(path)
    if LOSS in missing:
        batches = held_out_batches(config, dp, rank, world, loaded.device)
        loss, count = held_out_loss_of(loaded, config, batches, world)
        records.append(loss_record(step, loss, count, label))
    for task in options.tasks:
        if task.name in missing:
            scores = task_scores(loaded, config, task, rank, world)
            records.append(task_record(step, task.name, scores, label))
    return Evaluated(records)
