"""A mixture-of-experts model at 2 real ranks (torchrun, gloo, fp32) against 1 rank: expert
parallelism, FSDP2, the pipeline, resharding between them, and an exact resume of the
sigmoid router's balancing bias.

Every micro-batch holds one row at every layout (1 rank: 4 micro-batches of 1), because the
balancing loss and the capacity are functions of a micro-batch's tokens: so equal layouts see
equal micro-batches, and the runs must agree to fp32 rounding.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.conftest import TINY
from tests.distributed.test_equivalence import assert_matches, records, train, weights

# sigmoid routing with the balancing bias, capacity dropping, a shared expert and both
# auxiliary losses: every part of the layer is on the path being compared
MOE = """
moe_num_experts = 4
moe_top_k = 2
moe_shared_experts = 1
moe_hidden_dim = 48
moe_router = "sigmoid"
moe_capacity_factor = 1.25
moe_aux_loss_weight = 0.01
moe_z_loss_weight = 0.001
moe_bias_update_rate = 0.01
"""

# every layout evaluates the same 8 rows, one per forward
ONE_ROW = ["--train.batch_size=1", "--checkpoint.export_final=false"]
DATA_PARALLEL = [*ONE_ROW, "--distributed.dp_shard=2", "--train.grad_accum_steps=2"]
EP = [*DATA_PARALLEL, "--distributed.ep=2", "--eval.steps=4"]
FSDP2 = [*DATA_PARALLEL, "--eval.steps=4"]
PP = [
    *ONE_ROW,
    "--distributed.pp=2",
    "--distributed.dp_shard=1",
    "--train.grad_accum_steps=4",
    "--eval.steps=8",
]
ONE_RANK = [*ONE_ROW, "--train.grad_accum_steps=4", "--eval.steps=8"]
# tensor parallelism on attention and the dense block, the experts whole on both peers
TP = [*ONE_RANK, "--distributed.tp=2", "--distributed.dp_shard=1"]
MOE_METRICS = ("moe/aux_loss", "moe/z_loss", "moe/dropped_fraction", "moe/load_cv")


def write_moe_config(tmp: pathlib.Path, data: pathlib.Path, extra: str = "") -> pathlib.Path:
    path = tmp / "moe.toml"
    text = TINY.format(data=data).replace("[model]\n", "[model]\n" + MOE + extra, 1)
    path.write_text(text.replace("n_layers = 2", "n_layers = 3"))
    return path


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, small_corpus):
    tmp = tmp_path_factory.mktemp("moe_ref")
    config = write_moe_config(tmp, small_corpus, "moe_first_dense = 1\n")
    train(config, tmp / "run", *ONE_RANK)
    return config, tmp / "run"


def assert_moe_metrics_match(
    reference: pathlib.Path, run_dir: pathlib.Path, pipeline: bool = False
) -> None:
    ref = {r["step"]: r for r in records(reference)}
    for got in records(run_dir):
        for key in MOE_METRICS:
            assert got[key] == pytest.approx(ref[got["step"]][key], rel=1e-5, abs=1e-7), key
    ref_loads = records(reference, "moe/layer_loads")
    assert [r["step"] for r in ref_loads] == [5]  # on eval steps: 8 rows x 32 tokens x top-2
    assert [sum(layer) for layer in ref_loads[0]["moe/layer_loads"]] == [512.0, 512.0]
    got_loads = records(run_dir, "moe/layer_loads")
    if pipeline:  # the pipeline's evaluation reports the loss only
        assert got_loads == []
    else:
        assert got_loads[0]["moe/layer_loads"] == ref_loads[0]["moe/layer_loads"]


def bias_of(config: pathlib.Path, run_dir: pathlib.Path, step: int) -> torch.Tensor:
    state = weights(config, run_dir, step)
    return torch.stack([v for k, v in state.items() if k.endswith("expert_bias")])


# four ranks: one row and one micro-batch each, 2 eval batches
FOUR = [*ONE_ROW, "--train.grad_accum_steps=1", "--eval.steps=2", "--distributed.ep=2"]
EP_OF_FOUR = [*FOUR, "--distributed.dp_shard=4"]  # each expert FSDP-sharded over 2 ranks
EP_REPLICATED = [*FOUR, "--distributed.dp_replicate=2", "--distributed.dp_shard=2"]
LAYOUTS = [
    ("ep=2", EP, 2),
    ("fsdp2", FSDP2, 2),
    ("pp=2", PP, 2),
    ("tp=2", TP, 2),
    ("ep=2 of dp_shard=4", EP_OF_FOUR, 4),
    ("dp_replicate=2 x ep=2", EP_REPLICATED, 4),
]


@pytest.mark.parametrize(("args", "ranks"), [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_moe_at_several_ranks_matches_one_rank(moe_reference, tmp_path, small_corpus, args, ranks):
    config = write_moe_config(tmp_path, small_corpus, "moe_first_dense = 1\n")
    train(config, tmp_path / "run", *args, ranks=ranks)
    assert_matches(moe_reference, config, tmp_path / "run")
    assert_moe_metrics_match(moe_reference[1], tmp_path / "run", pipeline=args is PP)
    assert bias_of(config, tmp_path / "run", 5).abs().sum() > 0  # the bias did move


# (case, first run's args and ranks, resumed run's args and ranks)
RESHARD = [
    ("ep=2 -> ep=1", (EP, 2), (FSDP2, 2)),
    ("ep=1 -> ep=2", (FSDP2, 2), (EP, 2)),
    ("ep=2 -> 1 rank", (EP, 2), (ONE_RANK, 1)),
    ("ep=2 of dp_shard=4 -> 1 rank", (EP_OF_FOUR, 4), (ONE_RANK, 1)),
]


@pytest.mark.parametrize(("first", "second"), [r[1:] for r in RESHARD], ids=[r[0] for r in RESHARD])
def test_an_expert_parallel_checkpoint_resumes_under_another_layout(
    moe_reference, tmp_path, small_corpus, first, second
):
    config = write_moe_config(tmp_path, small_corpus, "moe_first_dense = 1\n")
    run_dir = tmp_path / "run"
    train(config, run_dir, *first[0], "--train.max_steps=3", ranks=first[1])
    train(config, run_dir, *second[0], ranks=second[1])
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4, 5]
    assert_matches(moe_reference, config, run_dir)


def test_a_resumed_run_continues_the_balancing_bias_bit_exactly(tmp_path, small_corpus):
    config = write_moe_config(tmp_path, small_corpus)
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = [*ONE_RANK, "--checkpoint.interval=3"]
    train(config, whole, *args)
    train(config, split, *args, "--train.max_steps=3")
    assert torch.equal(bias_of(config, split, 3), bias_of(config, whole, 3))
    train(config, split, *args)
    assert [r["loss"] for r in records(split)] == [r["loss"] for r in records(whole)]
    a, b = weights(config, whole, 5), weights(config, split, 5)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert bias_of(config, whole, 5).abs().sum() > 0


OPTIONS = [
    ("activation checkpointing", ["--train.activation_checkpointing=full"]),
    ("compile", ["--train.compile=true"]),
    ("chunked loss off", ["--train.loss_chunk_size=0"]),
]


@pytest.mark.parametrize("option", [o[1] for o in OPTIONS], ids=[o[0] for o in OPTIONS])
def test_moe_trains_alike_under_each_option(moe_reference, tmp_path, small_corpus, option):
    """One rank, the reference's layout, with one option changed."""
    config = write_moe_config(tmp_path, small_corpus, "moe_first_dense = 1\n")
    train(config, tmp_path / "run", *ONE_RANK, *option)
    assert_matches(moe_reference, config, tmp_path / "run")
