"""The frontier recipes at real ranks (torchrun, gloo, CPU, fp32) against one rank.

Multi-token prediction (``model.mtp_depth = 2``, packed documents): in every layout of the
composition table at 4 ranks (PP × FSDP and PP × CP in default CI, the others opt-in:
``FORGE_SLOW_TESTS=1``; tied embeddings, two sources, the chunked loss; every logged
metric and weight within 1e-5, a resume at the same layout bit for bit, a reshard to one
rank: ``tests/distributed/test_compositions.py``'s ``assert_composition``); under TP, CP and
PP at 2 ranks with the plain and the chunked loss; on a mixture of experts under FSDP2 ×
expert parallelism at 2, and with the depths' blocks mixtures of experts
(``model.mtp_moe``) under PP × FSDP2 × EP at 4 and TP at 2. Latent attention
(``[model.mla]``): in every layout of the table without CP at 4 ranks (CP is refused; PP × TP
in default CI, the others opt-in), under
TP and PP at 2 with and without the query bottleneck, and with MTP on a mixture of experts
under FSDP2 × EP at 2.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.conftest import layout_params
from tests.distributed.test_compositions import (
    LAYOUTS,
    ONE_RANK,
    PP_FSDP_EP,
    THREE_STEPS,
    assert_same_metrics,
    assert_same_weights,
    training_metrics,
    write_mixture_config,
)
from tests.distributed.test_compositions import assert_composition as assert_at_four
from tests.distributed.test_equivalence import train, write_config
from tests.distributed.test_moe_parallel import EP, write_moe_config
from tests.distributed.test_moe_parallel import ONE_RANK as MOE_ONE_RANK
from tests.distributed.test_moe_parallel import TP as MOE_TP

MTP = "mtp_depth = 2\n"
PACKED = "[data]\npack_documents = true\n"


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The one-rank run of a config's text and arguments (three steps), trained once per
    module: the cases of a test that share their reference compare against the same run."""
    runs: dict[tuple[str, tuple[str, ...]], pathlib.Path] = {}

    def reference(config: pathlib.Path, *args: str) -> pathlib.Path:
        key = (config.read_text(), args)
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("one_rank") / "one"
            train(config, runs[key], *THREE_STEPS, *args)
        return runs[key]

    return reference


def with_mtp(path: pathlib.Path) -> pathlib.Path:
    text = path.read_text().replace("[model]\n", "[model]\n" + MTP, 1)
    path.write_text(text.replace("[data]\n", PACKED, 1))
    return path


LATENT = "\n[model.mla]\nkv_rank = 16\nq_rank = 8\nnope_dim = 8\nrope_dim = 4\nv_dim = 8\n"


def with_latent(path: pathlib.Path) -> pathlib.Path:
    # latent attention has no key/value heads of its own: the key is refused with it
    path.write_text(path.read_text().replace("n_kv_heads = 2\n", "", 1) + LATENT)
    return path


@pytest.mark.parametrize(
    ("model_keys", "latent"),
    [("", False), ("", True), ("mtp_moe = true\n", False)],
    ids=["mtp", "mtp and latent attention", "mtp with expert depth blocks"],
)
def test_experts_with_depths_under_fsdp_x_ep_at_two_ranks_equal_one_rank(
    one_rank, tmp_path, small_corpus, model_keys, latent
):
    keys = "moe_first_dense = 1\n" + model_keys
    config = with_mtp(write_moe_config(tmp_path, small_corpus, keys))
    if latent:
        config = with_latent(config)
    one = one_rank(config, *MOE_ONE_RANK)
    train(config, tmp_path / "two", *THREE_STEPS, *EP, ranks=2)
    ref, got = training_metrics(one), training_metrics(tmp_path / "two")
    assert "mtp/loss_2" in ref[3] and "moe/load_cv" in ref[3]
    assert_same_metrics(got, ref, steps=(1, 2, 3))
    assert_same_weights(config, one, tmp_path / "two", step=3)


AT_TWO = ["--distributed.dp_shard=1", "--train.batch_size=4", "--train.grad_accum_steps=2",
          "--eval.steps=4"]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "chunk"),
    [
        ("--distributed.tp=2", "--train.loss_chunk_size=0"),
        ("--distributed.tp=2", "--train.loss_chunk_size=16"),
        ("--distributed.cp=2", "--train.loss_chunk_size=0"),
        ("--distributed.cp=2", "--train.loss_chunk_size=16"),
        ("--distributed.pp=2", "--train.loss_chunk_size=0"),
        ("--distributed.pp=2", "--train.loss_chunk_size=16"),
    ],
    ids=[
        "tp, plain loss",
        "tp, chunked loss",
        "cp, plain loss",
        "cp, chunked loss",
        "pp, plain loss",
        "pp, chunked loss",
    ],
)
def test_mtp_under_tensor_context_or_pipeline_parallelism_at_two_ranks_equals_one_rank(
    one_rank, tmp_path, small_corpus, layout, chunk
):
    """Packed documents: under context parallelism a depth's last tokens and targets at the
    end of a rank's chunk lie in its peer's chunk."""
    config = with_mtp(write_config(tmp_path, small_corpus))
    one = one_rank(config, *ONE_RANK, chunk)
    train(config, tmp_path / "two", *THREE_STEPS, layout, *AT_TWO, chunk, ranks=2)
    ref, got = training_metrics(one), training_metrics(tmp_path / "two")
    assert "mtp/loss_2" in ref[3]
    assert_same_metrics(got, ref, steps=(1, 2, 3))
    assert_same_weights(config, one, tmp_path / "two", step=3)


@pytest.fixture(scope="module")
def mtp_mixture(tmp_path_factory, small_corpus, second_corpus):
    """The composition table's config (two sources, tied embeddings, the chunked loss) with
    two depths on packed documents, and its one-rank run."""
    tmp = tmp_path_factory.mktemp("mtp_mixture")
    config = with_mtp(write_mixture_config(tmp, small_corpus, second_corpus))
    train(config, tmp / "one", *THREE_STEPS, *ONE_RANK)
    assert "mtp/loss_2" in training_metrics(tmp / "one")[3]
    return config, tmp / "one"


# default CI: the two layouts that put the depths on a pipeline's last stage beside FSDP2 and
# context parallelism (each parallelism's own MTP case runs at 2 ranks above); the rest opt-in
@pytest.mark.parametrize("args", layout_params(LAYOUTS, {"pp x fsdp", "pp x cp"}))
def test_mtp_in_each_composition_at_four_ranks_trains_resumes_and_reshards_as_one_rank(
    mtp_mixture, tmp_path, args
):
    assert_at_four(*mtp_mixture, tmp_path, args, ONE_RANK)


@pytest.fixture(scope="module")
def latent_mixture(tmp_path_factory, small_corpus, second_corpus):
    """The composition table's config with latent attention, and its one-rank run."""
    tmp = tmp_path_factory.mktemp("latent_mixture")
    config = with_latent(write_mixture_config(tmp, small_corpus, second_corpus))
    train(config, tmp / "one", *THREE_STEPS, *ONE_RANK)
    return config, tmp / "one"


# context parallelism is refused with latent attention (its attention has no context path)
WITHOUT_CP = [c for c in LAYOUTS if "cp" not in c[0]]


# default CI: tensor parallelism (the heads split) in a pipeline; the rest opt-in
@pytest.mark.parametrize("args", layout_params(WITHOUT_CP, {"pp x tp"}))
def test_latent_attention_in_each_composition_without_cp_at_four_ranks_as_one_rank(
    latent_mixture, tmp_path, args
):
    assert_at_four(*latent_mixture, tmp_path, args, ONE_RANK)


def test_experts_with_expert_depth_blocks_under_pp_x_fsdp_x_ep_at_four_ranks_as_one_rank(
    one_rank, tmp_path, small_corpus
):
    """DeepSeek-V3's form (``model.mtp_moe``): the depths' blocks are mixtures of experts on
    the last stage, their experts split over the expert-parallel ranks."""
    keys = "moe_first_dense = 1\nmtp_moe = true\n"
    config = with_mtp(write_moe_config(tmp_path, small_corpus, keys))
    one = one_rank(config, *MOE_ONE_RANK)
    assert "mtp/loss_2" in training_metrics(one)[3]
    assert_at_four(config, one, tmp_path, PP_FSDP_EP, MOE_ONE_RANK)


def test_experts_with_expert_depth_blocks_under_tensor_parallelism_at_two_ranks_as_one_rank(
    one_rank, tmp_path, small_corpus
):
    keys = "moe_first_dense = 1\nmtp_moe = true\n"
    config = with_mtp(write_moe_config(tmp_path, small_corpus, keys))
    one = one_rank(config, *MOE_ONE_RANK)
    train(config, tmp_path / "two", *THREE_STEPS, *MOE_TP, ranks=2)
    ref, got = training_metrics(one), training_metrics(tmp_path / "two")
    assert_same_metrics(got, ref, steps=(1, 2, 3))
    assert_same_weights(config, one, tmp_path / "two", step=3)


@pytest.mark.parametrize("q_rank", [8, 0], ids=["query bottleneck", "full query projection"])
@pytest.mark.parametrize("layout", ["--distributed.tp=2", "--distributed.pp=2"], ids=["tp", "pp"])
def test_latent_attention_under_tensor_or_pipeline_parallelism_at_two_ranks_equals_one_rank(
    one_rank, tmp_path, small_corpus, layout, q_rank
):
    """Under TP the heads split; the compressions are computed whole on each rank."""
    config = with_latent(write_config(tmp_path, small_corpus))
    config.write_text(config.read_text().replace("q_rank = 8", f"q_rank = {q_rank}"))
    one = one_rank(config, *ONE_RANK)
    train(config, tmp_path / "two", *THREE_STEPS, layout, *AT_TWO, ranks=2)
    ref, got = training_metrics(one), training_metrics(tmp_path / "two")
    assert_same_metrics(got, ref, steps=(1, 2, 3))
    assert_same_weights(config, one, tmp_path / "two", step=3)
