"""Two parallelisms at once, at 4 ranks (torchrun, gloo, CPU, fp32), against one rank.

Each layout trains 3 steps of a two-source mixture with tied embeddings and the chunked loss
(the defaults), then: every logged metric that does not measure the machine equals the one
rank's (loss, grad norm, lr, tokens, the per-source losses and tokens, the eval loss) within
1e-5, and so does every weight read back into one process (a reshard to 1 rank); resumed at 4
ranks from its own step-2 checkpoint it reproduces step 3 bit for bit; resumed at 1 rank from
that checkpoint it reproduces the one rank's step 3 within 1e-5. A mixture-of-experts model
does the same under pipeline stages, FSDP2 and expert parallelism at once (its MoE metrics
among the compared ones).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from tests.distributed.test_equivalence import records, train, weights, write_config
from tests.distributed.test_moe_parallel import ONE_RANK as MOE_ONE_RANK
from tests.distributed.test_moe_parallel import ONE_ROW, write_moe_config

# metrics that measure the machine, not the training: they differ between any two runs (and
# a one-rank run has no stragglers to name)
MACHINE = ("step_time", "tokens_per_sec", "tokens_per_sec_per_device", "tflops", "mfu")
MACHINE += ("straggler/slowest_rank", "straggler/ratio")
# memory/, checkpoint/ (a save's times, and its bytes: a layout's own files) and goodput (the
# ledger: time) are left out too

MIXTURE = """
[[data.sources]]
name = "json_email"
path = "{a}"
weight = 3.0

[[data.sources]]
name = "unittest"
path = "{b}"
weight = 1.0
"""

THREE_STEPS = ["--train.max_steps=3", "--checkpoint.interval=2", "--eval.interval=3"]

# (case, args): 4 ranks, a global batch of 8 rows per step and 16 held-out rows per eval
LAYOUTS = [
    ("fsdp x tp", ["--distributed.dp_shard=2", "--distributed.tp=2", "--train.batch_size=2",
                   "--train.grad_accum_steps=2", "--eval.steps=4"]),
    ("hsdp", ["--distributed.dp_replicate=2", "--distributed.dp_shard=2",
              "--train.batch_size=1", "--train.grad_accum_steps=2", "--eval.steps=4"]),
    ("pp x fsdp", ["--distributed.pp=2", "--distributed.dp_shard=2", "--train.batch_size=2",
                   "--train.grad_accum_steps=2", "--eval.steps=4"]),
    ("pp x tp", ["--distributed.pp=2", "--distributed.tp=2", "--distributed.dp_shard=1",
                 "--train.batch_size=4", "--train.grad_accum_steps=2", "--eval.steps=4"]),
    ("cp x tp", ["--distributed.cp=2", "--distributed.tp=2", "--distributed.dp_shard=1",
                 "--train.batch_size=4", "--train.grad_accum_steps=2", "--eval.steps=4"]),
    ("pp x cp", ["--distributed.pp=2", "--distributed.cp=2", "--distributed.dp_shard=1",
                 "--train.batch_size=4", "--train.grad_accum_steps=2", "--eval.steps=4"]),
]  # fmt: skip

ONE_RANK = ["--train.batch_size=4", "--train.grad_accum_steps=2", "--eval.steps=4"]


def write_mixture_config(tmp: pathlib.Path, a: pathlib.Path, b: pathlib.Path) -> pathlib.Path:
    """The tiny config, tied embeddings, and two sources (the first one's held-out split)."""
    path = write_config(tmp, a)
    text = path.read_text().replace("[model]\n", "[model]\ntie_embeddings = true\n")
    text = text.replace(f'[data]\npath = "{a}"\n', "[data]\n")
    path.write_text(text + MIXTURE.format(a=a, b=b))
    return path


def training_metrics(run_dir: pathlib.Path) -> dict[int, dict[str, float]]:
    """Each step's logged values, the machine's measurements left out."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" not in record:
            continue
        kept = {
            k: v
            for k, v in record.items()
            if k != "step" and k not in MACHINE and not k.startswith(("memory/", "checkpoint/", "goodput"))
            and isinstance(v, (int, float))
        }  # fmt: skip
        out.setdefault(record["step"], {}).update(kept)
    return out


def assert_same_metrics(got: dict, ref: dict, steps) -> None:
    for step in steps:
        assert got[step].keys() == ref[step].keys(), step
        for key, value in ref[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-8), (step, key)


def assert_same_weights(config, ref_dir, run_dir, step, exact=False) -> None:
    ref_w, got_w = weights(config, ref_dir, step), weights(config, run_dir, step)
    assert ref_w.keys() == got_w.keys()
    for name, tensor in ref_w.items():
        if exact:
            assert torch.equal(got_w[name], tensor), name
        else:
            torch.testing.assert_close(got_w[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def from_step_2(run_dir: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A new run folder holding only ``run_dir``'s step-2 checkpoint (auto-resume takes it)."""
    shutil.copytree(run_dir / "checkpoints" / "step_2", into / "checkpoints" / "step_2")
    return into


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, small_corpus, second_corpus):
    """The config and the one-rank run every layout is compared with."""
    tmp = tmp_path_factory.mktemp("mixture")
    config = write_mixture_config(tmp, small_corpus, second_corpus)
    train(config, tmp / "one", *THREE_STEPS, *ONE_RANK)
    logged = training_metrics(tmp / "one")[3]
    assert "data/unittest/loss" in logged and "eval/loss" in logged  # what is compared
    return config, tmp / "one"


@pytest.mark.parametrize("args", [c[1] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_a_composition_at_four_ranks_trains_resumes_and_reshards_as_one_rank(
    mixture, tmp_path, args
):
    assert_composition(*mixture, tmp_path, args, ONE_RANK)


# pipeline stages, each FSDP2-sharded over 2 ranks that split its experts; one row per
# micro-batch at every layout (the capacity and balancing loss are per micro-batch)
PP_FSDP_EP = [*ONE_ROW, "--distributed.pp=2", "--distributed.dp_shard=2", "--distributed.ep=2",
              "--train.grad_accum_steps=2", "--eval.steps=4"]  # fmt: skip


def test_moe_under_pp_x_fsdp_x_ep_trains_resumes_and_reshards_as_one_rank(tmp_path, small_corpus):
    config = write_moe_config(tmp_path, small_corpus, "moe_first_dense = 1\n")
    one_rank = MOE_ONE_RANK
    train(config, tmp_path / "one", *THREE_STEPS, *one_rank)
    assert "moe/load_cv" in training_metrics(tmp_path / "one")[3]
    assert_composition(config, tmp_path / "one", tmp_path, PP_FSDP_EP, one_rank)


def assert_composition(config, one, tmp_path, args, one_rank) -> None:
    """``args`` at 4 ranks equals the one-rank run ``one`` in every logged metric and weight,
    resumes from its own step-2 checkpoint bit for bit, and reshards to ``one_rank``."""
    run = tmp_path / "run"
    train(config, run, *THREE_STEPS, *args, ranks=4)
    ref = training_metrics(one)
    got = training_metrics(run)
    assert_same_metrics(got, ref, steps=(1, 2, 3))
    assert_same_weights(config, one, run, step=3)

    resumed = from_step_2(run, tmp_path / "resumed")
    train(config, resumed, *THREE_STEPS, *args, ranks=4)
    assert [r["step"] for r in records(resumed)] == [3]
    again = training_metrics(resumed)[3]
    assert {k: got[3][k] for k in again} == again  # bit for bit
    assert_same_weights(config, run, resumed, step=3, exact=True)

    alone = from_step_2(run, tmp_path / "alone")
    train(config, alone, *THREE_STEPS, *one_rank)
    assert_same_metrics(training_metrics(alone), ref, steps=(3,))
    assert_same_weights(config, one, alone, step=3)
