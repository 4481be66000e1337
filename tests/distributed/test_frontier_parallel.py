"""The frontier recipes at real ranks (torchrun, gloo, CPU, fp32) against one rank:
multi-token prediction (``model.mtp_depth = 2``, packed documents, the chunked loss) and
latent attention (``[model.mla]``), each under HSDP at 4 ranks (every logged metric and
weight within 1e-5, a resume at the same layout bit for bit, a reshard to one rank:
``tests/distributed/test_compositions.py``'s ``assert_composition``) and on a mixture of
experts under FSDP2 × expert parallelism at 2 (with dense depth blocks, and with the depths'
blocks mixtures of experts: ``model.mtp_moe``)."""

from __future__ import annotations

import pathlib

import pytest

from tests.distributed.test_compositions import (
    ONE_RANK,
    THREE_STEPS,
    assert_same_metrics,
    assert_same_weights,
    training_metrics,
)
from tests.distributed.test_compositions import assert_composition as assert_at_four
from tests.distributed.test_equivalence import train, write_config
from tests.distributed.test_moe_parallel import EP, write_moe_config
from tests.distributed.test_moe_parallel import ONE_RANK as MOE_ONE_RANK

MTP = "mtp_depth = 2\n"
PACKED = "[data]\npack_documents = true\n"


def with_mtp(path: pathlib.Path) -> pathlib.Path:
    text = path.read_text().replace("[model]\n", "[model]\n" + MTP, 1)
    path.write_text(text.replace("[data]\n", PACKED, 1))
    return path


HSDP = ["--distributed.dp_replicate=2", "--distributed.dp_shard=2", "--train.batch_size=1",
        "--train.grad_accum_steps=2", "--eval.steps=4"]  # fmt: skip


def test_mtp_under_hsdp_at_four_ranks_trains_resumes_and_reshards_as_one_rank(
    tmp_path, small_corpus
):
    config = with_mtp(write_config(tmp_path, small_corpus))
    train(config, tmp_path / "one", *THREE_STEPS, *ONE_RANK)
    assert {"mtp/loss_1", "mtp/loss_2"} <= training_metrics(tmp_path / "one")[3].keys()
    assert_at_four(config, tmp_path / "one", tmp_path, HSDP, ONE_RANK)


LATENT = "\n[model.mla]\nkv_rank = 16\nq_rank = 8\nnope_dim = 8\nrope_dim = 4\nv_dim = 8\n"


def with_latent(path: pathlib.Path) -> pathlib.Path:
    path.write_text(path.read_text() + LATENT)
    return path


def test_latent_attention_under_hsdp_at_four_ranks_trains_resumes_and_reshards_as_one_rank(
    tmp_path, small_corpus
):
    config = with_latent(write_config(tmp_path, small_corpus))
    train(config, tmp_path / "one", *THREE_STEPS, *ONE_RANK)
    assert_at_four(config, tmp_path / "one", tmp_path, HSDP, ONE_RANK)


@pytest.mark.parametrize(
    ("model_keys", "latent"),
    [("", False), ("", True), ("mtp_moe = true\n", False)],
    ids=["mtp", "mtp and latent attention", "mtp with expert depth blocks"],
)
def test_experts_with_depths_under_fsdp_x_ep_at_two_ranks_equal_one_rank(
    tmp_path, small_corpus, model_keys, latent
):
    keys = "moe_first_dense = 1\n" + model_keys
    config = with_mtp(write_moe_config(tmp_path, small_corpus, keys))
    if latent:
        config = with_latent(config)
    train(config, tmp_path / "one", *THREE_STEPS, *MOE_ONE_RANK)
    train(config, tmp_path / "two", *THREE_STEPS, *EP, ranks=2)
    ref, got = training_metrics(tmp_path / "one"), training_metrics(tmp_path / "two")
    assert "mtp/loss_2" in ref[3] and "moe/load_cv" in ref[3]
    assert_same_metrics(got, ref, steps=(1, 2, 3))
    assert_same_weights(config, tmp_path / "one", tmp_path / "two", step=3)


AT_TWO = ["--distributed.dp_shard=1", "--train.batch_size=4", "--train.grad_accum_steps=2",
          "--eval.steps=4"]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "chunk"),
    [
        ("--distributed.tp=2", "--train.loss_chunk_size=0"),
        ("--distributed.tp=2", "--train.loss_chunk_size=16"),
        ("--distributed.cp=2", "--train.loss_chunk_size=0"),
        ("--distributed.cp=2", "--train.loss_chunk_size=16"),
    ],
    ids=["tp, plain loss", "tp, chunked loss", "cp, plain loss", "cp, chunked loss"],
)
def test_mtp_under_tensor_or_context_parallelism_at_two_ranks_equals_one_rank(
    tmp_path, small_corpus, layout, chunk
):
    """Packed documents: under context parallelism a depth's last tokens and targets at the
    end of a rank's chunk lie in its peer's chunk."""
    config = with_mtp(write_config(tmp_path, small_corpus))
    train(config, tmp_path / "one", *THREE_STEPS, *ONE_RANK, chunk)
    train(config, tmp_path / "two", *THREE_STEPS, layout, *AT_TWO, chunk, ranks=2)
    ref, got = training_metrics(tmp_path / "one"), training_metrics(tmp_path / "two")
    assert "mtp/loss_2" in ref[3]
    assert_same_metrics(got, ref, steps=(1, 2, 3))
    assert_same_weights(config, tmp_path / "one", tmp_path / "two", step=3)
