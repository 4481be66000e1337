"""Evaluates a run's checkpoints beside its training: ``python scripts/eval_follow.py runs/debug``.

Follows a run directory (its checkpoints local or in an object store) and, for each committed
checkpoint, computes what in-loop evaluation would at that step (the held-out loss on the same
rows, and the run's ``[[eval.tasks]]`` or ``--tasks``), then waits for the next. Results go
to ``<run>/eval_follow.jsonl``, one line per step and task, each recorded exactly once across
restarts; a step that retention removed before the follower reached it is recorded as
skipped. While it reads a checkpoint the follower pins it, so the trainer's retention leaves
it alone. It stops once the run has committed its last step (``train.max_steps``) and every
step asked for has its record, or at Ctrl-C / SIGTERM (exit 130, nothing half-recorded).
Under ``torchrun --nproc_per_node=N`` the ranks share the rows and requests, each with the
whole model. See docs/evaluation.md#beside-training.
"""

from __future__ import annotations

import argparse
import pathlib

from forge.cli import add_device_options, help_first, run_path, summary, task_names


def parser() -> argparse.ArgumentParser:
    """The options ``main`` reads, built before torch is imported (``help_first``)."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("run", type=run_path, help="the run directory to follow")
    parser.add_argument(
        "--every", type=int, default=None,
        help="evaluate steps that are multiples of this (and the last); default: the run's "
        "eval.interval, or every committed step when it is 0",
    )  # fmt: skip
    parser.add_argument("--tasks", type=task_names, default=None, help="lm-eval tasks, a,b")
    parser.add_argument("--include-path", type=pathlib.Path, default=None, help="task YAMLs")
    parser.add_argument("--limit", type=int, default=None, help="documents per --tasks task")
    parser.add_argument("--no-loss", action="store_true", help="tasks only, no held-out loss")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between looks")
    parser.add_argument(
        "--pin-ttl-s", type=float, default=300.0,
        help="a pin this follower leaves (killed) stops counting after this long",
    )  # fmt: skip
    parser.add_argument(
        "--start-timeout-s", type=float, default=600.0,
        help="how long to wait for the run's config.toml to appear",
    )  # fmt: skip
    add_device_options(parser)
    return parser


help_first(__name__, lambda args: parser().parse_args(args))

import contextlib
import fcntl
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.pins import finish_all_deferred, reclaim_pins
from forge.config.data import EvalTask
from forge.console import console_may_close
from forge.errors import UserInputError, one_line, print_errors
from forge.interrupts import exits_on_interrupt
from forge.metrics.backends import TensorBoardSink, WandbSink
from forge.metrics.sinks import MetricsSink
from forge.parallel.devices import DeviceChoice, run_on_chosen_device, start_script_world
from forge.parallel.world import WorldInfo
from forge.training.evaluation.follow import (
    LOCK_FILE,
    LOSS,
    REMOVED,
    RESULTS_FILE,
    Decision,
    FollowAction,
    append_record,
    damaged_lines,
    json_lines,
    next_action,
    repair_tail,
    skipped_record,
)
from forge.training.evaluation.follower import (
    FollowOptions,
    evaluate_step,
    held_out_problem,
    look,
)
from forge.training.evaluation.inference import LoadedModel, load_for_inference, load_run_weights
from forge.training.records.run_dir import checkpoint_dir_of, load_run_config
from forge.types import ExitCode

HOLDER = "eval_follow"  # one follower per run (its lock): a pin by this name is its own


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    return run_on_chosen_device(parser().parse_args(argv), follow)


def option_problems(args: argparse.Namespace) -> list[str]:
    lines = []
    if args.every is not None and args.every < 1:
        lines.append(f"--every: must be >= 1, got {args.every}")
    if not 0 < args.poll_s <= 3600:
        lines.append(f"--poll-s: must be > 0 and <= 3600, got {args.poll_s}")
    if not 1 <= args.pin_ttl_s <= 86400:
        ttl = args.pin_ttl_s
        lines.append(
            f"--pin-ttl-s: must be >= 1 (a pin is renewed every third of it) and <= 86400 (a "
            f"killed follower's pin keeps retention off that long), got {ttl}"
        )
    if not 0 <= args.start_timeout_s < math.inf:
        lines.append(f"--start-timeout-s: must be a finite number >= 0, got {args.start_timeout_s}")
    if args.limit is not None and args.limit < 1:
        lines.append(f"--limit: must be >= 1, got {args.limit}")
    if args.tasks is not None and not args.tasks:
        lines.append("--tasks: name at least one lm-eval task, e.g. --tasks hellaswag")
    return lines


def wait_for_run(run: pathlib.Path, timeout_s: float, say: Callable[[str], None]) -> None:
    """Until ``run/config.toml`` exists (a follower started beside its trainer may be first)."""
    if (run / "config.toml").is_file():
        return
    if run.exists() and not run.is_dir():
        raise UserInputError([f"{run}: a file, not a run directory"])
    say(f"waiting for {run}/config.toml (the trainer writes it at its start)")
    deadline = time.monotonic() + timeout_s
    while not (run / "config.toml").is_file():
        if time.monotonic() > deadline:
            raise UserInputError(
                [f"{run}: no config.toml after {timeout_s:g} s (--start-timeout-s); start the "
                 "trainer with this run.dir, or pass the run directory of one"]
            )  # fmt: skip
        time.sleep(min(1.0, timeout_s))


def hold_lock(run: pathlib.Path) -> Any:
    """The follower's lock on ``run`` (an open file; the OS lets it go when the process ends),
    or ``UserInputError`` naming the follower that holds it."""
    path = run / LOCK_FILE
    try:
        f = path.open("a+")
    except OSError as exc:
        raise UserInputError([f"{path}: cannot be written ({exc.strerror})"]) from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserInputError(
            [f"{run}: already followed by {holder} (eval_follow.py); one follower per run: "
             "stop that one, or wait for it to end"]
        ) from None  # fmt: skip
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        f.flush()
    except OSError as exc:  # the holder's name only serves messages: the lock is held
        print(f"[eval_follow] warning: {path}: {exc.strerror}", file=sys.stderr)
    return f


def tasks_of(args: argparse.Namespace, config_tasks: tuple[EvalTask, ...]) -> tuple[EvalTask, ...]:
    if args.tasks is None:
        return config_tasks
    include = str(args.include_path) if args.include_path else None
    return tuple(EvalTask(name, include, args.limit) for name in args.tasks)


def task_problems(tasks: tuple[EvalTask, ...], where: str) -> list[str]:
    """The tasks' problems before any model is loaded: the extra, folders, names."""
    if not tasks:
        return []
    from forge.harness.tasks import (
        lm_eval_problem,
        path_lines,
        unknown_task_lines,
    )

    missing = lm_eval_problem()
    if missing is not None:
        return [missing]
    lines = path_lines(list(tasks), where)
    if lines:
        return lines
    return unknown_task_lines(list(tasks), where)


def broadcast(value: Any, world: WorldInfo) -> Any:
    """Rank 0's ``value`` on every rank."""
    if world.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def report(line: str) -> None:
    print(f"[eval_follow] {line}", file=sys.stderr, flush=True)


def follow(args: argparse.Namespace, world: WorldInfo, choice: DeviceChoice) -> int:
    """What ``main`` describes, on ``choice``'s device; the exit code."""
    main_rank = world.rank == 0
    lock = None
    try:
        lines = option_problems(args) + ([choice.problem] if choice.problem else [])
        if not lines and args.tasks:  # known before the run is: checked before waiting for it
            lines = task_problems(tasks_of(args, ()), "--tasks")
        if lines:
            raise UserInputError(lines)
        run = args.run
        wait_for_run(run, args.start_timeout_s, report if main_rank else lambda _: None)
        config = load_run_config(run)
        tasks = tasks_of(args, config.eval.tasks)
        lines = [] if args.tasks else task_problems(tasks, "eval.tasks")
        if tasks and config.model.vlm is not None:
            lines.append(f"{run}: a vision-language run; lm-eval tasks score text")
        if not args.no_loss and (problem := held_out_problem(config)) is not None:
            lines.append(problem)
        if lines:
            raise UserInputError(lines)
        lock = hold_lock(run) if main_rank else None
        every = args.every or config.eval.interval or 1
        what = (() if args.no_loss else (LOSS,)) + tuple(t.name for t in tasks)
        saved = config.checkpoint.interval
        if main_rank and config.checkpoint.enabled and every % saved and saved % every:
            report(
                f"warning: --every {every}: the run saves every {saved} steps, so only the "
                "steps that are multiples of both (and its last) have a checkpoint to evaluate"
            )
        if not what:
            raise UserInputError(
                ["--no-loss: and the run has no [[eval.tasks]] (nor --tasks): nothing to evaluate"]
            )
        root = checkpoint_dir_of(config, run)
        device = start_script_world(world, choice, config.distributed.timeout_s)
    except UserInputError as exc:
        if main_rank or choice.problem is not None:
            print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    options = FollowOptions(every, tasks, args.poll_s, args.pin_ttl_s, HOLDER)
    try:
        return follow_run(args, world, options, what, root, device)
    except (UserInputError, OSError) as exc:  # before the loop (its start, its sinks)
        if main_rank:
            print_errors(problem_lines(exc, args.run / RESULTS_FILE))
        return ExitCode.CONFIG_ERROR
    finally:
        if lock is not None:
            lock.close()


def follow_run(
    args: argparse.Namespace,
    world: WorldInfo,
    options: FollowOptions,
    what: tuple[str, ...],
    root: CheckpointPath,
    device: torch.device,
) -> int:
    """The follower's loop: look, decide (rank 0), act (every rank)."""
    run: pathlib.Path = args.run
    main_rank = world.rank == 0
    results = run / RESULTS_FILE
    if main_rank:
        repair_tail(results)
        with contextlib.suppress(OSError):  # what an earlier follower left: taken up now
            reclaim_pins(root, HOLDER)
            finish_all_deferred(root, time.time())
        damaged = damaged_lines(results)
        if damaged:
            report(f"warning: {results}: {damaged} damaged line(s) passed over (not results)")
        report(
            f"following {run} (checkpoints in {root}): {', '.join(what)}, every {options.every} "
            f"step(s); results in {results}"
        )
    model: list[LoadedModel] = []

    def load(path: CheckpointPath) -> LoadedModel:
        config = load_run_config(run)
        if not model:
            model.append(load_for_inference(config, run, path, device, args.dtype, lambda _: None))
        else:
            held = model[0]
            load_run_weights(config, run, path, held.model, held.optimizer, lambda _: None)
        return model[0]

    def sync(value: Any) -> Any:
        return broadcast(value, world)

    counts = {"evaluated": 0, "skipped": 0}
    sinks = follower_sinks(run) if main_rank else []
    try:
        return follow_steps(args, world, options, what, root, load, sync, sinks, counts)
    finally:
        for sink in sinks:
            with contextlib.suppress(Exception):
                sink.close()


def follower_sinks(run: pathlib.Path) -> list[MetricsSink]:
    """TensorBoard (``<run>/tensorboard/eval_follow``: a run beside the trainer's, its steps
    the same) and W&B (a run of its own in the trainer's project and group), as the run's
    ``[metrics]`` asks; ``eval_follow.jsonl`` is the record, these are views of it."""
    metrics = load_run_config(run).metrics
    sinks: list[MetricsSink] = []
    if metrics.tensorboard:
        sinks.append(TensorBoardSink(run / "tensorboard" / HOLDER))
    if metrics.wandb:
        sinks.append(WandbSink(load_run_config(run), run, role=HOLDER))
    return sinks


def follow_steps(
    args: argparse.Namespace,
    world: WorldInfo,
    options: FollowOptions,
    what: tuple[str, ...],
    root: CheckpointPath,
    load: Callable[[CheckpointPath], LoadedModel],
    sync: Callable[[Any], Any],
    sinks: list[MetricsSink],
    counts: dict[str, int],
) -> int:
    """Look, decide (rank 0), act (every rank), until the decision is to stop. What rank 0
    alone does (looking, recording) may fail: its lines go to every rank with the next
    decision, so that all of them end together (exit 2), none waiting in a collective."""
    run: pathlib.Path = args.run
    main_rank = world.rank == 0
    results = run / RESULTS_FILE
    problem: list[str] | None = None
    while True:
        decision: Decision | None = None
        if main_rank and problem is None:
            try:
                view = look(run, root, load_run_config(run), json_lines(results))
                decision = next_action(view, what, options.every)
                if decision.action is FollowAction.STOP:
                    finish_all_deferred(root, time.time())
            except (UserInputError, OSError) as exc:
                problem = problem_lines(exc, results)
        decision, problem = broadcast((decision, problem), world)
        if problem is not None:
            if main_rank:
                print_errors(problem)
            return ExitCode.CONFIG_ERROR
        assert decision is not None
        if decision.action is FollowAction.STOP:
            if main_rank:
                report(
                    f"done: the run completed; {counts['evaluated']} step(s) evaluated and "
                    f"{counts['skipped']} skipped by this follower"
                )
            return ExitCode.OK
        if decision.action is FollowAction.WAIT:
            time.sleep(options.poll_s)
            continue
        step = decision.step
        assert step is not None
        records: list[dict] = []
        reason = decision.reason or REMOVED
        if decision.action is FollowAction.EVALUATE:
            config = load_run_config(run)
            done = evaluate_step(
                step, decision.missing, root, options, load, config, world.rank,
                world.world_size, sync,
            )  # fmt: skip
            if done is not None and done.unreadable is None:
                records = done.records
            elif done is not None:
                reason = f"the checkpoint could not be read: {done.unreadable}"
        if not main_rank:
            continue
        try:
            if records:
                record_results(results, records, sinks)
                counts["evaluated"] += 1
                report(f"step {step}: " + summary_of(records))
            else:
                skip(results, step, decision.missing, reason, counts)
        except OSError as exc:
            problem = problem_lines(exc, results)


def problem_lines(exc: UserInputError | OSError, results: pathlib.Path) -> list[str]:
    """The lines a failure of rank 0's own work ends the follower with."""
    if isinstance(exc, UserInputError):
        return list(exc.lines)
    where = exc.filename or results
    return [
        f"{where}: cannot be written ({exc.strerror or exc}); the records so far stand: free "
        "space (or fix the permissions) and start the follower again"
    ]


def record_results(results: pathlib.Path, records: list[dict], sinks: list[MetricsSink]) -> None:
    """A step's results: each a line of the record, then shown by each view (a view that
    fails is dropped with a warning; the record stands)."""
    for record in records:
        append_record(results, record)
    for sink in list(sinks):
        try:
            for record in records:
                sink.write({k: v for k, v in record.items() if is_metric(k)})
        except Exception as exc:
            sinks.remove(sink)
            report(f"warning: {type(sink).__name__} dropped: {one_line(exc)}")


def is_metric(key: str) -> bool:
    """The keys a view (TensorBoard, W&B) shows: the step and its ``eval/`` scores."""
    return key == "step" or key.startswith("eval/")


def skip(
    results: pathlib.Path,
    step: int,
    missing: tuple[str, ...],
    reason: str,
    counts: dict[str, int],
) -> None:
    """Record ``step``'s ``missing`` results as skipped for ``reason`` (rank 0)."""
    for w in missing:
        append_record(results, skipped_record(step, w, reason))
    counts["skipped"] += 1
    report(f"step {step}: skipped ({reason})")


def summary_of(records: list[dict]) -> str:
    """The scores of a step's new records, for its one line."""
    parts = []
    for r in records:
        for k, v in r.items():
            if k.startswith("eval/") and k != "eval/tokens" and isinstance(v, float):
                parts.append(f"{k} {v:.4f}")
    return " | ".join(parts) or "no scores"


if __name__ == "__main__":
    sys.exit(main())
