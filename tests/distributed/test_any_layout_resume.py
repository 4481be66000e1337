"""A resume on another split of the same global batch continues the uninterrupted run.

One uninterrupted run (1 rank, 4 rows × 2 micro-batches = 8 rows a step, a two-source mixture,
packed documents, a phase from step 5 that drops a source and halves the LR) is the reference.
Each row of the table resumes a step-3 checkpoint, written by the reference or by a run of
another layout, on another layout and trains to step 6 (torchrun, gloo, CPU, fp32). Steps 4-6
must consume exactly the reference's rows (per-source token counts, ``data/rows`` and the
``data/rows_digest`` of every row consumed, all equal) and reach its losses within 1e-5.
"""

from __future__ import annotations

import pathlib
import shutil

import pytest

from tests.distributed.test_compositions import write_mixture_config
from tests.distributed.test_equivalence import train

PHASE = """
[[data.phases]]
start_step = 5
weights = { json_email = 0.0 }
lr_scale = 0.5
"""

RUN = ["--train.max_steps=6", "--checkpoint.interval=3", "--eval.interval=0",
       "--data.pack_documents=true"]  # fmt: skip
REFERENCE = ["--train.batch_size=4", "--train.grad_accum_steps=2"]

# (case, the layout that writes step 3 (None: the reference), its ranks, the resumed layout,
# its ranks); every layout is 8 rows a step
TABLE = [
    ("1 rank -> 1 rank, b8 x acc1", None, 1, ["--train.batch_size=8", "--train.grad_accum_steps=1"], 1),
    ("1 rank -> 1 rank, b2 x acc4", None, 1, ["--train.batch_size=2", "--train.grad_accum_steps=4"], 1),
    ("1 rank -> 1 rank, b1 x acc8", None, 1, ["--train.batch_size=1", "--train.grad_accum_steps=8"], 1),
    ("1 rank -> 2 ranks FSDP, b1 x acc4", None, 1, ["--train.batch_size=1", "--train.grad_accum_steps=4"], 2),
    ("2 ranks FSDP b2 x acc2 -> 1 rank b8 x acc1",
     ["--train.batch_size=2", "--train.grad_accum_steps=2"], 2,
     ["--train.batch_size=8", "--train.grad_accum_steps=1"], 1),
    ("4 ranks pp x fsdp b2 x acc2 -> 1 rank b1 x acc8",
     ["--distributed.pp=2", "--distributed.dp_shard=2", "--train.batch_size=2",
      "--train.grad_accum_steps=2"], 4,
     ["--train.batch_size=1", "--train.grad_accum_steps=8"], 1),
    ("2 ranks replicas b2 x acc2 -> 2 ranks FSDP b4 x acc1",
     ["--distributed.dp_replicate=2", "--distributed.dp_shard=1", "--train.batch_size=2",
      "--train.grad_accum_steps=2"], 2,
     ["--distributed.dp_shard=2", "--train.batch_size=4", "--train.grad_accum_steps=1"], 2),
    ("2 ranks FSDP b2 x acc2 -> 2 ranks replicas b1 x acc4",
     ["--distributed.dp_shard=2", "--train.batch_size=2", "--train.grad_accum_steps=2"], 2,
     ["--distributed.dp_replicate=2", "--distributed.dp_shard=1", "--train.batch_size=1",
      "--train.grad_accum_steps=4"], 2),
    ("2 ranks cp b4 x acc2 -> 1 rank b2 x acc4",
     ["--distributed.cp=2", "--distributed.dp_shard=1", "--train.batch_size=4",
      "--train.grad_accum_steps=2"], 2,
     ["--train.batch_size=2", "--train.grad_accum_steps=4"], 1),
]  # fmt: skip

EXACT = ("data/rows", "data/rows_digest", "data/json_email/tokens", "data/unittest/tokens")
CLOSE = ("loss", "grad_norm", "lr", "data/unittest/loss")


def logged(run_dir: pathlib.Path) -> dict[int, dict]:
    """Each step's logged values, the digest (a string) included."""
    import json

    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record.get("step"), {}).update(record)
    return out


def assert_continues(got: dict[int, dict], ref: dict[int, dict], steps) -> None:
    for step in steps:
        for key in EXACT:
            assert got[step][key] == ref[step][key], (step, key)
        for key in CLOSE:
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-5), (step, key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus, second_corpus):
    """The mixture config with its phase, and the uninterrupted one-rank run."""
    tmp = tmp_path_factory.mktemp("any_layout")
    config = write_mixture_config(tmp, small_corpus, second_corpus)
    config.write_text(config.read_text() + PHASE)
    train(config, tmp / "reference", *RUN, *REFERENCE)
    ref = logged(tmp / "reference")
    assert [ref[s]["data/json_email/tokens"] > 0 for s in (4, 5, 6)] == [True, False, False]
    assert ref[6]["lr"] < ref[4]["lr"] / 1.9  # the phase halves the LR inside the resumed span
    return config, tmp / "reference"


@pytest.mark.parametrize(
    ("case", "writer", "writer_ranks", "resumed", "ranks"), TABLE, ids=[c[0] for c in TABLE]
)
def test_a_resume_on_another_split_continues_the_uninterrupted_run(
    reference, tmp_path, case, writer, writer_ranks, resumed, ranks
):
    config, ref_dir = reference
    ref = logged(ref_dir)
    source = ref_dir
    if writer is not None:  # a run of another layout writes the step-3 checkpoint
        source = tmp_path / "writer"
        train(config, source, *RUN, "--train.max_steps=3", *writer, ranks=writer_ranks)
        assert_continues(logged(source), ref, steps=(1, 2, 3))
    run = tmp_path / "resumed"
    shutil.copytree(source / "checkpoints" / "step_3", run / "checkpoints" / "step_3")
    train(config, run, *RUN, *resumed, ranks=ranks)
    got = logged(run)
    assert sorted(s for s in got if s is not None) == [4, 5, 6]
    assert_continues(got, ref, steps=(4, 5, 6))
