"""Which lm-eval tasks a run or the harness script can run, and running them.

``lm_eval`` is imported inside the functions that need it: forge runs without the ``eval``
extra, and a config that asks for tasks without it is refused with one line.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import pathlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from forge.cache import this_cache_dir, write_cache_file
from forge.config.data import EvalTask
from forge.config.sections import JobConfig

LM_EVAL_SEEDS = (0, 1234, 1234, 1234)  # simple_evaluate's: Python, NumPy, torch, few-shot
TASKS_CACHE = "lm_eval_tasks.json"  # lm-eval's own task names, in forge's cache folder
CACHED_INSTALLS = 4  # entries kept: a few virtual environments share one home folder
MISSING_EXTRA = (
    "downstream tasks need lm-evaluation-harness, forge's 'eval' extra: pip install -e '.[eval]'"
)


def lm_eval_problem() -> str | None:
    """Why lm-eval cannot be used here (it is not installed), if so."""
    return MISSING_EXTRA if importlib.util.find_spec("lm_eval") is None else None


def include_paths(tasks: Sequence[EvalTask]) -> list[str]:
    """The task folders ``tasks`` name, each once, in order."""
    return list(dict.fromkeys(t.include_path for t in tasks if t.include_path))


def tasks_fingerprint(folder: pathlib.Path) -> str | None:
    """What a list of the tasks under ``folder`` (lm-eval's own) depends on: its task files'
    count, bytes and newest change (a reinstall or an edit changes it); None when a file
    cannot be read (one removed under the walk): then nothing is cached or read."""
    count, size, newest = 0, 0, 0
    try:
        for root, _, files in os.walk(folder):
            for name in files:
                if name.endswith((".yaml", ".yml", ".py")):
                    st = os.stat(os.path.join(root, name))
                    count, size = count + 1, size + st.st_size
                    newest = max(newest, st.st_mtime_ns)
    except OSError:
        return None
    return f"{count} files, {size} bytes, newest {newest}"


def cached_entries(path: pathlib.Path) -> dict[str, list[str]]:
    """Every valid entry of the cache file at ``path`` (names by key); none from a missing,
    unreadable or corrupt one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        return {}
    return {
        str(k): v
        for k, v in entries.items()
        if isinstance(v, list) and all(isinstance(n, str) for n in v)
    }


@functools.cache  # once per process: the index a check built serves the tasks' loading too
def lm_eval_index() -> Any:
    """lm-eval's ``TaskManager`` over its own tasks: thousands of YAML files read (10-15 s on
    a small machine)."""
    from lm_eval.tasks import TaskManager

    quiet_lm_eval()
    return TaskManager()


def default_task_names() -> frozenset[str]:
    """Every name lm-eval's own index holds (tasks, groups, tags), kept in forge's cache folder
    (``TASKS_CACHE``, the latest ``CACHED_INSTALLS`` installs of lm-eval by their version and
    ``tasks_fingerprint``): a start-up that checks a task name, or refuses a misspelt one,
    reads them instead of building the index."""
    import lm_eval
    import lm_eval.tasks

    fingerprint = tasks_fingerprint(pathlib.Path(lm_eval.tasks.__file__).parent)
    cache = this_cache_dir()
    if fingerprint is None or cache is None:
        return frozenset(lm_eval_index().all_tasks)
    path, key = cache / TASKS_CACHE, f"lm_eval {lm_eval.__version__} | {fingerprint}"
    entries = cached_entries(path)
    if key in entries:
        return frozenset(entries[key])
    names = sorted(lm_eval_index().all_tasks)
    kept = dict(list(entries.items())[-(CACHED_INSTALLS - 1) :]) | {key: names}
    write_cache_file(path, json.dumps({"entries": kept}) + "\n")  # unwritten: indexed again
    return frozenset(names)


def local_manager(paths: Sequence[str], names: Sequence[str]) -> Any | None:
    """An lm-eval ``TaskManager`` over the task folders ``paths`` alone (milliseconds) when it
    knows every one of ``names``, else None (lm-eval's own tasks are needed)."""
    from lm_eval.tasks import TaskManager

    if not paths:
        return None
    quiet_lm_eval()
    local = TaskManager(include_path=list(paths), include_defaults=False)
    return local if all(n in local.all_tasks for n in names) else None


def known_task_names(paths: Sequence[str], names: Sequence[str]) -> frozenset[str]:
    """The task names a ``task_manager(paths, names)`` knows, as far as ``names`` need:
    lm-eval's own from the cache (``default_task_names``)."""
    from lm_eval.tasks import TaskManager

    if (local := local_manager(paths, names)) is not None:
        return frozenset(local.all_tasks)
    if not paths:
        return default_task_names()
    mine = TaskManager(include_path=list(paths), include_defaults=False).all_tasks
    return frozenset(mine) | default_task_names()


def task_manager(paths: Sequence[str], names: Sequence[str]) -> Any:
    """An lm-eval ``TaskManager`` that knows ``names``: one over ``paths`` alone when they
    hold every name, else one over lm-eval's tasks too."""
    from lm_eval.tasks import TaskManager

    if (local := local_manager(paths, names)) is not None:
        return local
    return TaskManager(include_path=list(paths)) if paths else lm_eval_index()


def unknown_task_lines(tasks: Sequence[EvalTask], where: str) -> list[str]:
    """One line per task name lm-eval does not know (``known_task_names`` of the tasks' own
    folders), naming ``where`` it was asked."""
    known = known_task_names(include_paths(tasks), [t.name for t in tasks])
    lines = []
    for i, task in enumerate(tasks):
        if task.name not in known:
            found = f" or in {task.include_path}" if task.include_path else ""
            lines.append(
                f"{where.format(i=i)}: no lm-eval task {task.name!r} among lm-eval's "
                f"tasks{found}; check the name (lm-eval --tasks list) or the include path"
            )
    return lines


def path_lines(tasks: Sequence[EvalTask], where: str) -> list[str]:
    """One line per ``include_path`` that is not a folder."""
    return [
        f"{where.format(i=i)}: include_path {t.include_path}: no such folder"
        for i, t in enumerate(tasks)
        if t.include_path and not pathlib.Path(t.include_path).is_dir()
    ]


def downstream_problems(config: JobConfig) -> list[str]:
    """Why ``[[eval.tasks]]`` cannot run in this run, one line each (none without tasks)."""
    tasks = config.eval.tasks
    if not tasks:
        return []
    lines = []
    if config.eval.interval <= 0 and not config.eval.follow:  # a follower: every checkpoint
        lines.append("eval.tasks: set, but eval.interval is 0, so they would never run")
    if config.distributed.pp > 1 and not config.eval.follow:  # a follower loads whole models
        lines.append(
            "eval.tasks: not supported with distributed.pp > 1 (a pipeline stage has no "
            "logits of its own to score); score the checkpoints with scripts/eval_harness.py"
        )
    if config.model.vlm is not None:
        lines.append("eval.tasks: lm-eval tasks score text models; model.vlm is set")
    missing = lm_eval_problem()
    if missing is not None:
        return [*lines, f"eval.tasks: {missing}"]
    lines += path_lines(tasks, "eval.tasks[{i}]")
    if lines:
        return lines
    return unknown_task_lines(tasks, "eval.tasks[{i}].name")


def custom_dataset_note(record: logging.LogRecord) -> bool:
    """False for lm-eval's note on every task with a ``custom_dataset`` (it says how to pass
    keyword arguments on lm-eval's command line, which forge's scripts do not have)."""
    return "Custom kwargs can be passed" not in record.getMessage()


def quiet_lm_eval() -> None:
    """lm-eval's INFO lines off (forge reports what it ran); its warnings stay, but for one
    note that does not apply (filtered where it is logged: a filter sees only its own
    logger's records)."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    task_logger = logging.getLogger("lm_eval.api.task")
    if custom_dataset_note not in task_logger.filters:
        task_logger.addFilter(custom_dataset_note)


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's global generators as they were before the block, which
    seeds them as ``lm_eval.simple_evaluate`` does: a run that scores tasks must train as one
    that does not, and the scores must not depend on when they are taken."""
    python, numpy_state = random.getstate(), np.random.get_state()
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=gpus):
        try:
            random.seed(LM_EVAL_SEEDS[0])
            np.random.seed(LM_EVAL_SEEDS[1])
            torch.manual_seed(LM_EVAL_SEEDS[2])
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)


def sampling_problem(loaded: dict[str, Any]) -> str | None:
    """Why a loaded task cannot be scored: one that samples its generations (forge decodes
    greedily, so that a score is a function of the weights)."""
    for name, task in loaded.get("tasks", {}).items():
        kwargs = task.get_config("generation_kwargs") or {}
        if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
            return (
                f"{name}: its generation_kwargs sample (do_sample / temperature > 0); forge "
                "decodes greedily: set them to greedy in a copy of the task"
            )
    return None


def load_tasks(manager: Any, names: Sequence[str]) -> dict[str, Any]:
    """lm-eval's loaded tasks (``{"tasks", "groups"}``) for ``names``, zero-shot unless a
    task says otherwise: where a task's YAML, data or dependency errors raise, before any
    scoring starts (so that ranks can agree on a failure before their forwards)."""
    quiet_lm_eval()
    loaded = dict(manager.load(list(names)))
    problem = sampling_problem(loaded)
    if problem is not None:
        raise ValueError(problem)
    for task in loaded.get("tasks", {}).values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=LM_EVAL_SEEDS[3])
    return loaded


def score_tasks(
    lm: Any, loaded: dict[str, Any], limit: int | None, bootstrap_iters: int
) -> dict[str, Any]:
    """lm-eval's results (``results``, ``versions``, ``n-shot`` ...) of the ``loaded`` tasks
    scored by ``lm``, on at most ``limit`` documents each, on every rank (``lm`` reports
    itself as lm-eval's one rank: forge shares the requests out itself)."""
    from lm_eval.evaluator import evaluate

    quiet_lm_eval()
    with random_state_kept():
        out = evaluate(
            lm,
            loaded,  # type: ignore[arg-type]
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
            verbosity="WARNING",
        )
    return {} if out is None else dict(out)
