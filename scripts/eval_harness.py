"""Downstream scores of a trained model through lm-evaluation-harness: ``python
scripts/eval_harness.py runs/debug --tasks stdlib_line_order --include-path configs/tasks``.

Takes a run directory (the checkpoint training would resume from, found by the same resolver
as ``eval.py``) or one checkpoint directory, reads the DCP checkpoint as it is (no conversion
to Hugging Face), and scores lm-eval tasks with forge's model: log-likelihoods in batches of
``--batch-size`` requests sorted by length, greedy generation with the KV cache. Under
``torchrun --nproc_per_node=N`` each rank scores every N-th request and the results are
gathered, so the scores are the same at any rank count. Prints lm-eval's table and writes the
results as JSON into ``<run>/eval_harness/<checkpoint>.json`` (``--output`` elsewhere). Needs
the ``eval`` extra: ``pip install -e '.[eval]'``.
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
    parser.add_argument("path", type=run_path, help="a run directory or one checkpoint")
    parser.add_argument("--tasks", type=task_names, required=True, help="lm-eval tasks, a,b")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (all)")
    parser.add_argument(
        "--include-path", type=pathlib.Path, default=None, help="a folder of task YAMLs"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward")
    parser.add_argument(
        "--bootstrap-iters", type=int, default=100_000, help="lm-eval's stderr resamples"
    )
    parser.add_argument("--output", type=pathlib.Path, default=None, help="the JSON's path")
    add_device_options(parser)
    return parser


help_first(__name__, lambda args: parser().parse_args(args))

import json
import sys
from collections.abc import Sequence
from typing import Any

from forge.checkpoint.paths import CheckpointPath
from forge.config.data import EvalTask
from forge.console import console_may_close
from forge.errors import UserInputError, one_line, print_errors
from forge.harness.tasks import (
    include_paths,
    lm_eval_problem,
    load_tasks,
    path_lines,
    score_tasks,
    task_manager,
    unknown_task_lines,
)
from forge.interrupts import exits_on_interrupt
from forge.optim.optimizers import evaluation_weights
from forge.outputs import file_output_problem, replace_file
from forge.parallel.devices import DeviceChoice, run_on_chosen_device, start_script_world
from forge.parallel.world import WorldInfo
from forge.training.evaluation.inference import (
    LoadedModel,
    load_for_inference,
    run_dir_of,
    run_tokenizer,
    tokenizer_problem,
)
from forge.training.records.run_dir import load_run_config
from forge.types import ExitCode


def report(line: str) -> None:
    """A line about the checkpoint being read, on stderr."""
    print(line, file=sys.stderr)


def option_problems(args: argparse.Namespace) -> list[str]:
    """The options' own problems, before anything is read."""
    lines = []
    if not args.tasks:
        lines.append("--tasks: name at least one lm-eval task, e.g. --tasks hellaswag")
    if args.batch_size < 1:
        lines.append(f"--batch-size: must be >= 1, got {args.batch_size}")
    if args.limit is not None and args.limit < 1:
        lines.append(f"--limit: must be >= 1, got {args.limit}")
    if args.bootstrap_iters < 0:
        lines.append(
            f"--bootstrap-iters: must be >= 0 (0: no standard errors), got {args.bootstrap_iters}"
        )
    if args.output is not None:
        problem = output_problem(args.output)
        if problem is not None:
            lines.append(problem)
    return lines


def output_path(args: argparse.Namespace, run_dir: pathlib.Path, checkpoint: CheckpointPath):
    """Where the JSON goes: ``--output``, else ``<run>/eval_harness/<checkpoint name>.json``."""
    if args.output is not None:
        return args.output
    return run_dir / "eval_harness" / f"{checkpoint.name}.json"


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    """The script: options, the device, then ``evaluate``; the exit code."""
    return run_on_chosen_device(parser().parse_args(argv), evaluate)


def harness_record(path: pathlib.Path) -> bool:
    """Whether ``path`` holds an earlier result of this script (rewritten by a rerun)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"checkpoint", "tasks", "results"} <= record.keys()


def output_problem(out: pathlib.Path) -> str | None:
    """Why the JSON could not be written at ``out``: found before hours of scoring, with the
    rules of every output (``forge.outputs``)."""
    return file_output_problem(out, "--output", "eval_harness", harness_record)


def prepared(args: argparse.Namespace, world: WorldInfo, choice: DeviceChoice):
    """(the run directory, the loaded tasks, the loaded model, the run's config, the
    output path), or a ``UserInputError`` naming the problems found before scoring."""
    lines = option_problems(args)
    if choice.problem is not None:
        lines.append(choice.problem)
    missing = lm_eval_problem()
    if missing is not None:
        lines.append(missing)
    tasks = [EvalTask(n, str(args.include_path) if args.include_path else None) for n in args.tasks]
    lines += path_lines(tasks, "--include-path")
    if lines:
        raise UserInputError(lines)
    run_dir, checkpoint = run_dir_of(args.path)
    config = load_run_config(run_dir)
    if config.model.vlm is not None:
        raise UserInputError([f"{run_dir}: a vision-language run; lm-eval tasks score text"])
    problem = tokenizer_problem(config, run_dir)
    if problem is not None:
        raise UserInputError([problem])
    unknown = unknown_task_lines(tasks, "--tasks")
    if unknown:
        raise UserInputError(unknown)
    manager = task_manager(include_paths(tasks), args.tasks)
    try:  # a task's YAML, data or dependencies: read before the model is
        loaded_tasks = load_tasks(manager, args.tasks)
    except Exception as exc:  # lm-eval raises what its tasks' loaders raise
        raise UserInputError([f"{', '.join(args.tasks)}: lm-eval failed: {one_line(exc)}"]) from exc
    device = start_script_world(world, choice, config.distributed.timeout_s)
    loaded = load_for_inference(config, run_dir, checkpoint, device, args.dtype, report)
    out = output_path(args, run_dir, loaded.checkpoint)
    problem = output_problem(out)
    if problem is not None:
        raise UserInputError([problem])
    return loaded_tasks, loaded, config, out


def scores(args, world: WorldInfo, loaded: LoadedModel, tasks, config) -> dict[str, Any]:
    """lm-eval's results for the loaded ``tasks``, every rank scoring its share."""
    from forge.harness.backend import ForgeLM, Scoring, local_only, over_ranks
    from forge.harness.requests import Share

    gather = over_ranks if world.world_size > 1 else local_only
    scoring = Scoring(
        args.batch_size,
        Share(world.rank, world.world_size),
        gather=gather,
        max_len=config.train.seq_len,
    )
    lm = ForgeLM(loaded.model, run_tokenizer(config), loaded.device, scoring)
    loaded.model.eval()
    with evaluation_weights(loaded.optimizer):
        return score_tasks(lm, tasks, args.limit, args.bootstrap_iters)


def evaluate(args: argparse.Namespace, world: WorldInfo, choice: DeviceChoice) -> int:
    """The scoring ``main`` describes, on ``choice``'s device; the exit code."""
    try:
        tasks, loaded, config, out = prepared(args, world, choice)
    except UserInputError as exc:
        if world.rank == 0 or choice.problem is not None:  # a rank of its own: it says so
            print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    try:
        results = scores(args, world, loaded, tasks, config)
    except Exception as exc:  # a task's failure while scoring: one line, not lm-eval's trace
        if world.rank == 0:
            print_errors([f"{', '.join(args.tasks)}: lm-eval failed: {one_line(exc)}"])
        return ExitCode.CONFIG_ERROR
    if world.rank != 0:
        return ExitCode.OK
    from lm_eval.utils import make_table

    print(make_table(results))
    record = {
        "checkpoint": str(loaded.checkpoint),
        "tasks": args.tasks,
        "limit": args.limit,
        "device": choice.device,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        **{k: results[k] for k in ("results", "versions", "n-shot", "n-samples") if k in results},
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        replace_file(out, json.dumps(record, indent=2, default=str) + "\n")
    except OSError as exc:
        print_errors([f"--output {out}: could not be written: {one_line(exc)}"])
        return ExitCode.CONFIG_ERROR
    print(f"# wrote {out}", file=sys.stderr)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
