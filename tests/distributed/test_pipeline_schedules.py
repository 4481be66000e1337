"""Every pipeline schedule at pp=2 (torchrun, gloo, CPU, fp32) against one rank, and its resume.

A 4-layer model, 8 rows per step as 4 micro-batches of 2 (``dualpipev`` needs 2 × pp). Each
schedule trains 5 steps with a checkpoint at step 2 and equals one rank within 1e-5 in loss,
grad norm, eval loss and every weight; resumed from its step-2 checkpoint at its own layout it
repeats steps 3 to 5 bit for bit. Half the schedules run the features that once were refused
under PP, all at once: packed documents of unequal length (token-weighted micro-batches), the
z-loss and tied embeddings (across ranks in a looped layout, one weight on rank 0 in a V).
A checkpoint of two stages per rank resumes at one rank.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import torch

from tests.conftest import TINY
from tests.distributed.test_equivalence import assert_matches, records, train, weights

STEPS = [  # beside test_equivalence's COMMON: 5 steps, eval at step 5
    "--checkpoint.interval=2",
    "--train.batch_size=2",
    "--train.grad_accum_steps=4",
]
FEATURES = ["--data.pack_documents=true", "--train.z_loss_weight=1e-3"]
PP = ["--distributed.pp=2", "--distributed.dp_shard=1"]


def write_config(tmp: pathlib.Path, data: pathlib.Path, tied: bool = False) -> pathlib.Path:
    """TINY with 4 layers (4 stages at pp=2 × 2), tied embeddings in the file when asked
    (``weights`` rebuilds the model from it)."""
    tmp.mkdir(parents=True, exist_ok=True)
    model = "[model]\nn_layers = 4\n" + ("tie_embeddings = true\n" if tied else "")
    text = TINY.format(data=data).replace("[model]\n", model).replace("n_layers = 2\n", "")
    path = tmp / "tiny.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def plain(tmp_path_factory, small_corpus):
    """One rank, the plain model."""
    tmp = tmp_path_factory.mktemp("plain")
    config = write_config(tmp, small_corpus)
    train(config, tmp / "run", *STEPS)
    return config, tmp / "run"


@pytest.fixture(scope="module")
def features(tmp_path_factory, short_documents):
    """One rank with packing, the z-loss and tied embeddings."""
    tmp = tmp_path_factory.mktemp("features")
    config = write_config(tmp, short_documents, tied=True)
    train(config, tmp / "run", *STEPS, *FEATURES)
    return config, tmp / "run"


def resume_copy(run_dir: pathlib.Path, out: pathlib.Path, step: int) -> pathlib.Path:
    """A copy of ``run_dir`` as if it had stopped right after its step-``step`` checkpoint."""
    shutil.copytree(run_dir, out, symlinks=True)
    checkpoints = out / "checkpoints"
    for later in checkpoints.glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (checkpoints / "latest").unlink()
    os.symlink(f"step_{step}", checkpoints / "latest")
    commits = out / "checkpoints.jsonl"  # nor had it recorded the commits after it
    kept = [x for x in commits.read_text().splitlines() if json.loads(x)["step"] <= step]
    commits.write_text("".join(x + "\n" for x in kept))
    return out


# (schedule, stages per rank, with the features, extra args)
SCHEDULES = [
    ("gpipe", 1, False, []),
    ("1f1b", 1, True, []),
    ("interleaved_1f1b", 2, True, ["--train.loss_chunk_size=0"]),  # the z term from logits
    ("interleaved_zero_bubble", 2, False, []),
    ("zbv", 2, True, []),
    ("dualpipev", 2, False, []),
]


def schedule_args(kind: str, per_rank: int, featured: bool, extra: list[str]) -> list[str]:
    layout = [f"--distributed.pp_schedule={kind}", f"--distributed.pp_stages_per_rank={per_rank}"]
    return [*STEPS, *PP, *layout, *(FEATURES if featured else []), *extra]


@pytest.mark.parametrize("kind,per_rank,featured,extra", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_schedule_matches_one_rank_and_resumes_exactly(
    request, tmp_path, small_corpus, short_documents, kind, per_rank, featured, extra
):
    reference = request.getfixturevalue("features" if featured else "plain")
    config = write_config(tmp_path, short_documents if featured else small_corpus, tied=featured)
    args = schedule_args(kind, per_rank, featured, extra)
    run_dir = tmp_path / "run"
    train(config, run_dir, *args, ranks=2)
    assert_matches(reference, config, run_dir)
    if featured:  # the z term was logged, and a masked, packed batch still agrees
        assert all(r["z_loss"] > 0 for r in records(run_dir))
    again = resume_copy(run_dir, tmp_path / "again", 2)
    train(config, again, *args, ranks=2)
    first = {r["step"]: r for r in records(run_dir)}
    for r in records(again):
        assert (r["loss"], r["grad_norm"]) == (
            first[r["step"]]["loss"],
            first[r["step"]]["grad_norm"],
        )
    assert records(again, "eval/loss") == records(run_dir, "eval/loss")
    resumed, whole = weights(config, again, 5), weights(config, run_dir, 5)
    for name, tensor in whole.items():
        assert torch.equal(resumed[name], tensor), name


def test_a_checkpoint_of_two_stages_per_rank_resumes_at_one_rank(
    features, tmp_path, short_documents
):
    """interleaved_1f1b with tied embeddings: rank 0 holds stages 0 and 2 (the embedding),
    rank 1 stages 1 and 3 (the head, its weight also saved as the embedding); at one rank the
    union of their state dicts is the whole model."""
    config = write_config(tmp_path, short_documents, tied=True)
    run_dir = tmp_path / "run"
    args = schedule_args("interleaved_1f1b", 2, True, [])
    train(config, run_dir, *args, "--train.max_steps=3", ranks=2)  # checkpoints 2 and 3
    train(config, run_dir, *STEPS, *FEATURES)
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4, 5]
    assert_matches(features, config, run_dir)
