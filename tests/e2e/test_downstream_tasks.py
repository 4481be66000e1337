"""``[[eval.tasks]]``: lm-eval tasks scored during training at ``eval.interval``, logged to every
sink, a broken task a single warning, and a run that scores tasks training as one that does
not; at 2 ranks (FSDP) the ranks score in lockstep and finish."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from forge.config.loader import ConfigError
from forge.training.setup.phases import load_and_validate_config
from tests.conftest import REPO
from tests.e2e.sandbox import Run, make_run, train
from tests.ranks import run_ranks

TASKS = REPO / "configs" / "tasks"


def broken_task_folder(root: pathlib.Path) -> pathlib.Path:
    """A task lm-eval finds, whose data file is not there: it fails when it is run."""
    folder = root / "broken"
    folder.mkdir(exist_ok=True)
    (folder / "broken.yaml").write_text(
        "task: broken_task\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root}/missing.jsonl\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
    )
    return folder


def with_tasks(run: Run, *tasks: tuple[str, pathlib.Path, int]) -> Run:
    """``run``'s config with ``[eval] interval = 4`` and the given ``[[eval.tasks]]``."""
    text = run.config.read_text() + "\n[eval]\ninterval = 4\nsteps = 2\n"
    for name, folder, limit in tasks:
        text += f'\n[[eval.tasks]]\nname = "{name}"\ninclude_path = "{folder}"\nlimit = {limit}\n'
    run.config.write_text(text)
    return run


def records(run: Run) -> list[dict]:
    return [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def scored(tmp_path_factory, small_corpus) -> tuple[Run, str]:
    """A tiny run that scores the shipped task and a broken one at steps 4, 8 and 12."""
    root = tmp_path_factory.mktemp("scored")
    run = with_tasks(
        make_run(root, small_corpus),
        ("stdlib_line_order", TASKS, 12),
        ("broken_task", broken_task_folder(root), 4),
    )
    result = train(run, "--metrics.tensorboard=true")
    assert result.code == 0, result.stderr
    return run, result.stderr


def test_scores_are_logged_at_every_evaluation(scored):
    run, _ = scored
    scores = [r for r in records(run) if "eval/stdlib_line_order/acc" in r]
    assert [r["step"] for r in scores] == [4, 8, 12]
    for r in scores:
        assert 0 <= r["eval/stdlib_line_order/acc"] <= 1
        assert 0 <= r["eval/stdlib_line_order/acc_norm"] <= 1
    assert not any(k.startswith("eval/broken_task/") for r in records(run) for k in r)


def test_a_broken_task_warns_once_and_the_run_completes(scored):
    _, stderr = scored
    warnings = [line for line in stderr.splitlines() if "'broken_task' failed" in line]
    assert len(warnings) == 1
    assert "at step 4" in warnings[0] and "missing.jsonl" in warnings[0]
    assert "Traceback" not in stderr


def test_scores_reach_tensorboard(scored):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = scored
    events = EventAccumulator(str(run.dir / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("eval/stdlib_line_order/acc")]
    assert steps == [4, 8, 12]


def test_the_plot_has_a_downstream_panel(scored):
    from tests.e2e.test_train_script import load_script

    plot = load_script("plot_metrics")
    run, _ = scored
    panels = plot.panels_of({run.dir: records(run)})
    assert panels[-1][0] == "downstream tasks"
    assert [k for k, _ in panels[-1][1]] == [
        "eval/stdlib_line_order/acc",
        "eval/stdlib_line_order/acc_norm",
    ]


def test_a_run_that_scores_tasks_trains_as_one_that_does_not(scored, tmp_path, small_corpus):
    run, _ = scored
    plain = with_tasks(make_run(tmp_path, small_corpus))
    result = train(plain, "--metrics.tensorboard=true")
    assert result.code == 0, result.stderr

    def losses(r: Run) -> list[tuple[int, float]]:
        return [(x["step"], x["loss"]) for x in records(r) if "loss" in x]

    assert losses(run) == losses(plain)  # bit for bit: lm-eval's seeding is undone
    from forge.checkpoint.safety import load_tensors_safely

    for step in (5, 10, 12):  # the generators each checkpoint saved, after evaluations
        saved = [
            load_tensors_safely(r.ckpt / f"step_{step}" / "rng_rank0.pt") for r in (run, plain)
        ]
        assert torch.equal(saved[0]["torch_cpu"], saved[1]["torch_cpu"])
        assert saved[0]["python"] == saved[1]["python"]


def line_order_scores(run: Run) -> dict[int, float]:
    key = "eval/stdlib_line_order/acc"
    return {r["step"]: r[key] for r in records(run) if key in r}


@pytest.fixture(scope="module")
def one_rank_scores(tmp_path_factory, small_corpus) -> dict[int, float]:
    run = with_tasks(
        make_run(tmp_path_factory.mktemp("one_rank"), small_corpus),
        ("stdlib_line_order", TASKS, 10),
    )
    result = train(run, "--train.max_steps=8")
    assert result.code == 0, result.stderr
    return line_order_scores(run)


@pytest.mark.parametrize(
    "layout",
    [
        ["--distributed.dp_shard=2", "--train.batch_size=2"],  # the one rank's global batch
        ["--distributed.tp=2"],
        ["--distributed.cp=2"],
    ],
    ids=["fsdp", "tp", "cp"],
)
def test_two_ranks_score_in_lockstep_as_one_rank(tmp_path, small_corpus, layout, one_rank_scores):
    """Each data-parallel rank scores its share, tensor-parallel peers theirs together, and
    context-parallel peers the same share over whole rows: the scores are one rank's."""
    run = with_tasks(make_run(tmp_path, small_corpus), ("stdlib_line_order", TASKS, 10))
    train = str(REPO / "scripts" / "train.py")
    done = run_ranks(2, [train, str(run.config), "--train.max_steps=8", *layout], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    scores = line_order_scores(run)
    assert list(scores) == [4, 8]
    assert scores == pytest.approx(one_rank_scores, abs=1e-9)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ('[[eval.tasks]]\nname = "stdlib_line_order"\ninclude_path = "{tasks}"\n',
         "eval.tasks: set, but eval.interval is 0"),
        ('[eval]\ninterval = 2\n[[eval.tasks]]\nname = "nope_xyz"\ninclude_path = "{tasks}"\n',
         "eval.tasks[0].name: no lm-eval task 'nope_xyz'"),
        ('[eval]\ninterval = 2\n[[eval.tasks]]\nname = "x"\ninclude_path = "{tasks}/nowhere"\n',
         "eval.tasks[0]: include_path {tasks}/nowhere: no such folder"),
        ('[eval]\ninterval = 2\n[[eval.tasks]]\nname = " "\n',
         "eval.tasks[0].name: must name an lm-eval task"),
        ('[eval]\ninterval = 2\n[[eval.tasks]]\nname = "x"\nlimit = 0\n',
         "eval.tasks[0].limit: must be > 0"),
        ('[eval]\ninterval = 2\nbatch_size = 0\n', "eval.batch_size: must be > 0"),
    ],
)  # fmt: skip
def test_a_task_the_run_cannot_score_is_refused_at_start_up(tiny_config, extra, says):
    tiny_config.write_text(tiny_config.read_text() + "\n" + extra.format(tasks=TASKS))
    with pytest.raises(ConfigError) as caught:
        load_and_validate_config([str(tiny_config)])
    assert any(says.format(tasks=TASKS) in line for line in caught.value.lines)


def test_tasks_without_lm_eval_are_refused_naming_the_extra(tiny_config, monkeypatch):
    import forge.harness.tasks as tasks

    real = tasks.importlib.util.find_spec
    monkeypatch.setattr(
        tasks.importlib.util, "find_spec", lambda n, *a: None if n == "lm_eval" else real(n, *a)
    )
    tiny_config.write_text(
        tiny_config.read_text() + '\n[eval]\ninterval = 2\n[[eval.tasks]]\nname = "x"\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_and_validate_config([str(tiny_config)])
    assert caught.value.lines == [f"eval.tasks: {tasks.MISSING_EXTRA}"]
