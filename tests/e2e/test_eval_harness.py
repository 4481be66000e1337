"""scripts/eval_harness.py: lm-eval tasks scored on forge checkpoints (DCP, no conversion), the
shipped ``stdlib_line_order`` task, 1 and 2 ranks, and every refusal in one line."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from forge.checkpoint.store import save_model_only
from forge.cli import DtypeRequest
from forge.config import load_config
from forge.model.transformer import Transformer
from tests.conftest import REPO
from tests.e2e.test_train_script import load_script
from tests.ranks import run_ranks

HARNESS = load_script("eval_harness")
TASKS = REPO / "configs" / "tasks"
TASK = ["--tasks", "stdlib_line_order", "--include-path", str(TASKS)]

LEARNER = """\
[model]
dim = 64
n_layers = 2
n_heads = 4
vocab_size = 259
max_seq_len = 96

[train]
batch_size = 8
seq_len = 96
max_steps = 80
mixed_precision = "fp32"
seed = 5

[optimizer]
lr = 5e-3

[scheduler]
warmup_steps = 8

[data]
path = "{data}"

[checkpoint]
interval = 80

[metrics]
log_interval = 40

[run]
dir = "{run}"
"""


@pytest.fixture(scope="module")
def learned(tmp_path_factory, small_corpus) -> pathlib.Path:
    """A small model trained 80 steps on the ``json`` and ``email`` packages: it has learned
    enough Python to order a line's words, and nothing of the task's (held-out) files."""
    root = tmp_path_factory.mktemp("learned")
    config = root / "learner.toml"
    config.write_text(LEARNER.format(data=small_corpus, run=root / "run"))
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), str(config)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return root / "run"


@pytest.fixture(scope="module")
def untrained(learned, tmp_path_factory) -> pathlib.Path:
    """The same model as initialised, as a model-only checkpoint under a run directory."""
    root = tmp_path_factory.mktemp("untrained")
    shutil.copy(learned / "config.toml", root / "config.toml")
    cfg = load_config([str(root / "config.toml")]).config
    model = Transformer(cfg.model)
    model.init_weights(cfg.train.seed)
    return save_model_only(root / "checkpoints", 0, model, {"step": 0})


def scores(path: pathlib.Path, out: pathlib.Path, *extra: str) -> dict:
    code = HARNESS.main([str(path), *TASK, "--output", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())["results"]["stdlib_line_order"]


def test_a_trained_run_scores_above_chance_and_above_the_untrained_model(
    learned, untrained, tmp_path
):
    trained = scores(learned, tmp_path / "trained.json", "--limit", "100")
    initial = scores(untrained, tmp_path / "initial.json", "--limit", "100")
    assert trained["acc,none"] >= 0.4  # four choices: chance is 0.25
    assert trained["acc,none"] >= initial["acc,none"] + 0.15


def test_the_results_are_written_into_the_run_directory_by_default(learned, capsys):
    out = learned / "eval_harness" / "step_80.json"
    out.unlink(missing_ok=True)
    assert HARNESS.main([str(learned), *TASK, "--limit", "8"]) == 0
    record = json.loads(out.read_text())
    assert record["checkpoint"].endswith("step_80") and record["limit"] == 8
    assert record["results"]["stdlib_line_order"]["acc,none"] >= 0
    assert "stdlib_line_order" in capsys.readouterr().out  # lm-eval's table


def test_one_and_two_ranks_give_the_same_scores(learned, tmp_path):
    one = scores(learned, tmp_path / "one.json", "--limit", "24", "--batch-size", "5")
    done = run_ranks(
        2,
        [str(REPO / "scripts" / "eval_harness.py"), str(learned), *TASK, "--limit", "24",
         "--batch-size", "5", "--output", str(tmp_path / "two.json")],
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    two = json.loads((tmp_path / "two.json").read_text())["results"]["stdlib_line_order"]
    assert two["acc,none"] == one["acc,none"] and two["acc_norm,none"] == one["acc_norm,none"]
    assert done.stdout.count("stdlib_line_order") == 1  # the table, printed by rank 0 alone


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["{run}", "--tasks", "no_such_task_xyz", "--include-path", str(TASKS)],
         "--tasks: no lm-eval task 'no_such_task_xyz'"),
        (["{run}", "--tasks", ",", "--include-path", str(TASKS)], "--tasks: name at least one"),
        (["{run}", *TASK, "--limit", "0"], "--limit: must be >= 1, got 0"),
        (["{run}", *TASK, "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
        (["{run}", "--tasks", "x", "--include-path", "{run}/nowhere"],
         "--include-path: include_path {run}/nowhere: no such folder"),
        (["{run}/checkpoints", *TASK],
         "neither a run directory (config.toml) nor a checkpoint (train_state.json)"),
        (["{run}/nothing", *TASK], "neither a run directory"),
        (["{run}", *TASK, "--bootstrap-iters", "-1"], "--bootstrap-iters: must be >= 0"),
        # every file a script writes follows the rules of the output folders
        (["{run}", *TASK, "--output", "{run}/config.toml"], "lies in the run or checkpoint directory"),
        (["{run}", *TASK, "--output", "{run}/checkpoints/step_80/x.json"], "lies in the run or checkpoint directory"),
        (["{run}", *TASK, "--output", "{run}/.."], "is a folder; name the file to write"),
        (["{run}", *TASK, "--output", "{data}/manifest.json"], "lies inside the dataset"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(learned, small_corpus, capsys, args, says):
    before = {p: p.read_bytes() for p in learned.rglob("*") if p.is_file()}
    code = HARNESS.main([a.format(run=learned, data=small_corpus) for a in args])
    err = capsys.readouterr().err
    assert code == 2
    assert says.format(run=learned) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in learned.rglob("*") if p.is_file()} == before


def test_a_file_forge_did_not_write_is_never_overwritten(learned, tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    assert HARNESS.main([str(learned), *TASK, "--limit", "4", "--output", str(notes)]) == 2
    assert "holds a file forge did not write there" in capsys.readouterr().err
    assert notes.read_text() == '{"mine": 1}'


def test_ctrl_c_while_scoring_is_one_line_exit_130_and_nothing_written(learned, tmp_path):
    out = tmp_path / "scores.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "eval_harness.py"), str(learned), *TASK,
         "--output", str(out), "--batch-size", "1"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.stderr is not None
    seen = ""
    while "200/200" not in seen:  # lm-eval's contexts are built: scoring begins
        chunk = os.read(proc.stderr.fileno(), 4096).decode()
        assert chunk, f"ended before scoring: {seen}"
        seen += chunk
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, seen + rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
    assert [line for line in rest.splitlines() if line.startswith("interrupted")] == [
        "interrupted (SIGINT): stopped; nothing it was writing is left behind"
    ]
    assert not out.exists()


def test_a_damaged_checkpoint_is_one_line(learned, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(learned, copy)
    for shard in (copy / "checkpoints" / "step_80").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    code = HARNESS.main([str(copy / "checkpoints" / "step_80"), *TASK])
    err = capsys.readouterr().err
    assert code == 2 and "step_80" in err and "Traceback" not in err


def test_without_lm_eval_the_script_names_the_extra(learned, capsys, monkeypatch):
    import forge.harness.tasks as tasks

    real = tasks.importlib.util.find_spec
    monkeypatch.setattr(
        tasks.importlib.util, "find_spec", lambda n, *a: None if n == "lm_eval" else real(n, *a)
    )
    code = HARNESS.main([str(learned), *TASK])
    err = capsys.readouterr().err
    assert code == 2
    assert tasks.MISSING_EXTRA in err
    assert "pip install -e '.[eval]'" in err and len(err.strip().splitlines()) == 1


def test_a_task_whose_data_is_missing_fails_in_one_line(learned, tmp_path, capsys):
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "gone.yaml").write_text(
        "task: gone_task\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path}/missing.jsonl\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
    )
    code = HARNESS.main([str(learned), "--tasks", "gone_task", "--include-path", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "gone_task: lm-eval failed" in err and "missing.jsonl" in err
    assert "Traceback" not in err


def test_a_task_that_samples_is_refused_before_scoring(learned, tmp_path, capsys):
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "utils.py").write_text(
        "import datasets\n\ndef load(**_):\n"
        "    return {'test': datasets.Dataset.from_list([{'q': 'def', 'a': 'x'}])}\n"
    )
    (folder / "sampled.yaml").write_text(
        "task: sampled_task\ncustom_dataset: !function utils.load\n"
        "output_type: generate_until\ntest_split: test\ndoc_to_text: '{{q}}'\n"
        "doc_to_target: '{{a}}'\ngeneration_kwargs:\n  do_sample: true\n  temperature: 0.7\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    code = HARNESS.main([str(learned), "--tasks", "sampled_task", "--include-path", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "sampled_task: its generation_kwargs sample" in err
    assert "Traceback" not in err


def test_a_run_whose_tokenizer_is_gone_is_refused(learned, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(learned, run)
    config = (run / "config.toml").read_text()
    config = config.replace("vocab_size = 259", "vocab_size = 300")
    (run / "config.toml").write_text(re.sub(r'path = ".*"', f'path = "{tmp_path}/gone"', config))
    code = HARNESS.main([str(run), *TASK])
    err = capsys.readouterr().err
    assert code == 2 and f"the run's data {tmp_path}/gone is gone" in err


def test_the_loaded_model_is_the_checkpoints(learned):
    """The backend scores the weights of step 80, not an initialisation."""
    from forge.training.evaluation.inference import load_for_inference
    from forge.training.records.run_dir import load_run_config

    config = load_run_config(learned)
    loaded = load_for_inference(
        config, learned, None, torch.device("cpu"), DtypeRequest.AUTO, lambda _: None
    )
    assert loaded.checkpoint.name == "step_80"
    fresh = Transformer(config.model)
    fresh.init_weights(config.train.seed)
    assert not torch.equal(fresh.output.weight, loaded.model.output.weight)


def test_a_vision_language_run_is_refused_in_one_line(tmp_path, small_shapes, capsys):
    from tests.conftest import TINY_VLM

    run = tmp_path / "vlm"
    run.mkdir()
    config = TINY_VLM.format(arch="joint_decoder", data=small_shapes)
    (run / "config.toml").write_text(config)
    code = HARNESS.main([str(run), *TASK])
    err = capsys.readouterr().err
    assert code == 2 and "a vision-language run; lm-eval tasks score text" in err


def test_an_unwritable_output_is_one_line_and_nothing_half_written(learned, tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    code = HARNESS.main([str(learned), *TASK, "--limit", "4", "--output", f"{blocked}/r.json"])
    err = capsys.readouterr().err
    assert code == 2 and f"--output {blocked}/r.json: {blocked} is not a folder" in err
    assert "stdlib_line_order" not in capsys.readouterr().out  # refused before scoring
    assert blocked.read_text() == "not a folder" and "Traceback" not in err
