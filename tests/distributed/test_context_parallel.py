"""Context parallelism (``distributed.cp``) against one rank on the same global batch: loss,
grad norm, eval loss and every weight after 5 steps (torchrun, gloo, CPU, fp32)."""

from __future__ import annotations

import pytest

from tests.distributed.test_equivalence import assert_matches, records, train, write_config

# one rank: global batch 8 as 2 micro-batches of 4; every case below has the same batch
ONE_RANK = ["--train.batch_size=4", "--train.grad_accum_steps=2"]
CP2 = ["--distributed.cp=2", "--distributed.dp_shard=1", *ONE_RANK]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus):
    tmp = tmp_path_factory.mktemp("cp_ref")
    config = write_config(tmp, small_corpus)
    train(config, tmp / "run", *ONE_RANK)
    return config, tmp / "run"


def test_cp2_matches_one_rank(reference, tmp_path, small_corpus):
    config = write_config(tmp_path, small_corpus)
    train(config, tmp_path / "run", *CP2, ranks=2)
    assert_matches(reference, config, tmp_path / "run")
    # tokens per step over the whole batch, not this rank's part of it
    seen = [r["tokens_seen"] for r in records(tmp_path / "run")]
    assert (
        seen == [r["tokens_seen"] for r in records(reference[1])] == [256 * s for s in range(1, 6)]
    )


def test_cp2_with_fsdp2_matches_one_rank(reference, tmp_path, small_corpus):
    config = write_config(tmp_path, small_corpus)
    args = ["--distributed.cp=2", "--distributed.dp_shard=2", "--train.batch_size=2"]
    train(config, tmp_path / "run", *args, "--train.grad_accum_steps=2", ranks=4)
    assert_matches(reference, config, tmp_path / "run")


def test_cp2_resumes_at_one_rank(reference, tmp_path, small_corpus):
    """3 steps at cp=2 (a checkpoint at step 3), then on to step 5 on one rank."""
    config = write_config(tmp_path, small_corpus)
    run = tmp_path / "run"
    train(config, run, *CP2, "--train.max_steps=3", "--checkpoint.interval=3", ranks=2)
    train(config, run, *ONE_RANK, "--checkpoint.interval=5")
    assert_matches(reference, config, run, steps=range(4, 6))


def test_cp2_packed_documents_match_one_rank(tmp_path, short_documents):
    """Packed rows (document ids gathered for the mask), under a sliding window and full
    activation checkpointing (the gather runs again in the recomputed forward)."""
    packed = [
        "--data.pack_documents=true",
        "--model.sliding_window=12",
        "--train.activation_checkpointing=full",
    ]
    config = write_config(tmp_path, short_documents)
    train(config, tmp_path / "ref", *ONE_RANK, *packed)
    train(config, tmp_path / "cp", *CP2, *packed, ranks=2)
    assert_matches((config, tmp_path / "ref"), config, tmp_path / "cp")


def test_pp2_x_cp2_interleaved_on_packed_documents_matches_one_rank(tmp_path, short_documents):
    """Pipeline stages over context-parallel ranks (4 ranks, two stages per rank, 4 layers):
    each stage's attention gathers its CP peers' keys, and the document ids and positions of
    the rank's tokens travel with the hidden states."""
    model = ["--model.n_layers=4", "--data.pack_documents=true"]
    config = write_config(tmp_path, short_documents)
    train(config, tmp_path / "ref", *ONE_RANK, *model)
    pp = ["--distributed.pp=2", "--distributed.pp_schedule=interleaved_1f1b",
          "--distributed.pp_stages_per_rank=2"]  # fmt: skip
    train(config, tmp_path / "cp", *CP2, *pp, *model, ranks=4)
    assert_matches((config, tmp_path / "ref"), config, tmp_path / "cp")
