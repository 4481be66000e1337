"""scripts/eval.py: the held-out loss of a run or of one checkpoint, at 1 and 2 ranks."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from forge.checkpoint.store import load_checkpoint
from forge.config import Precision, load_config
from forge.data.batch import Batch
from forge.data.dataset import open_windows
from forge.data.shards import read_manifest
from forge.model.transformer import Transformer
from forge.training.evaluation.evaluate import evaluate_loss
from tests.conftest import REPO
from tests.e2e.test_train_script import load_script
from tests.in_process import run_main
from tests.ranks import run_ranks

EVAL_SCRIPT = load_script("eval")


def evaluate(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    """``scripts/eval.py args`` at ``ranks`` real ranks; one rank in this process (what it
    reads and prints is all that is asked of it)."""
    if ranks > 1:
        return run_ranks(ranks, [str(REPO / "scripts" / "eval.py"), *args])
    return run_main(EVAL_SCRIPT.main, args)


def all_windows(windows) -> list[Batch]:
    """Every window, one per batch (independent of the script's own batching)."""
    rows = [torch.from_numpy(windows[i].astype("int64"))[None] for i in range(len(windows))]
    return [Batch(r[:, :-1], r[:, 1:]) for r in rows]


def expected_loss(trained, step: int) -> float:
    """The same loss computed here: every validation window, the checkpoint's weights."""
    cfg = load_config([str(trained.config)]).config
    model = Transformer(cfg.model)
    load_checkpoint(trained.ckpt / f"step_{step}", model, None, restore_rng_state=False)
    manifest = read_manifest(trained.data)
    windows = open_windows(trained.data, manifest, "validation", cfg.train.seq_len, False)
    total, count = evaluate_loss(model, all_windows(windows), Precision.FP32)
    return total / count


def test_eval_of_a_run_uses_its_newest_checkpoint_and_every_window(trained):
    done = evaluate(str(trained.dir), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["checkpoint"].endswith("step_10") and result["split"] == "validation"
    assert result["loss"] == pytest.approx(expected_loss(trained, 10), rel=1e-6)
    assert result["perplexity"] == pytest.approx(torch.tensor(result["loss"]).exp().item())


def test_eval_of_one_checkpoint_and_at_two_ranks_is_the_same_loss(trained):
    one = evaluate(str(trained.ckpt / "step_5"), "--json")
    two = evaluate(str(trained.ckpt / "step_5"), "--json", ranks=2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout.strip().splitlines()[-1])
    assert a["checkpoint"].endswith("step_5") and a["tokens"] == b["tokens"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert a["loss"] == pytest.approx(expected_loss(trained, 5), rel=1e-6)


def test_bfloat16_weights_give_nearly_the_fp32_loss_and_say_so(trained):
    done = evaluate(str(trained.ckpt / "step_5"), "--json", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["dtype"] == "bfloat16" and result["device"] == "cpu"
    reference = expected_loss(trained, 5)
    assert result["loss"] == pytest.approx(reference, rel=2e-2)
    assert result["loss"] != pytest.approx(reference, rel=1e-7)  # the weights were cast


@pytest.mark.parametrize(
    "args,line",
    [
        (["/nonexistent/run"], "neither a run directory (config.toml) nor a checkpoint"),
        (["{run}", "--split", "test"], "no split 'test'; it has ['train', 'validation']"),
        (["{run}", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
        (["{run}", "--data", "/nonexistent/data"], "/nonexistent/data/manifest.json"),
        pytest.param(
            ["{run}", "--device", "cuda"],
            "--device cuda: torch sees no GPU here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
        ),
    ],
)
def test_bad_eval_input_is_one_line_exit_2(trained, args, line, capsys):
    code = EVAL_SCRIPT.main([a.format(run=trained.dir) for a in args])
    assert code == 2
    captured = capsys.readouterr()
    errors = captured.err.strip().splitlines()
    assert len(errors) == 1 and line in errors[0], errors
    assert captured.out == ""
