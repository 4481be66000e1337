"""A freeze schedule across a resume: before, at and after its transitions, at one rank and
at two (FSDP2), the resumed run is the uninterrupted one bit for bit; a different schedule is
refused naming the differing entries."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.distributed.test_equivalence import (
    COMMON,
    assert_matches,
    records,
    train,
    weights,
    write_config,
)

# blocks frozen for steps 1-2, the embedding for 1-3: transitions before steps 3 and 4
FREEZE = """
[[freeze]]
module = "layers"
until_step = 2

[[freeze]]
module = "tok_embeddings"
until_step = 3
"""
WARMUP = "--scheduler.warmup_steps=1"  # a run may stop at step 2
FSDP2 = ["--distributed.dp_shard=2", "--train.batch_size=2", "--train.grad_accum_steps=2", WARMUP]
ONE = ["--train.batch_size=4", "--train.grad_accum_steps=2", WARMUP]


def freeze_config(tmp: pathlib.Path, data: pathlib.Path, extra: str = FREEZE) -> pathlib.Path:
    config = write_config(tmp, data)
    config.write_text(config.read_text() + extra)
    return config


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, small_corpus):
    tmp = tmp_path_factory.mktemp("freeze")
    config = freeze_config(tmp, small_corpus)
    train(config, tmp / "one", *ONE)
    train(config, tmp / "two", *FSDP2, ranks=2)
    return config, tmp


def assert_bit_exact(config: pathlib.Path, whole: pathlib.Path, split: pathlib.Path) -> None:
    assert [r["loss"] for r in records(split)] == [r["loss"] for r in records(whole)]
    a, b = weights(config, whole, 5), weights(config, split, 5)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "stop", [2, 3, 4], ids=["just before the first", "between the two", "after both"]
)
def test_a_resume_across_the_transitions_is_bit_exact(uninterrupted, tmp_path, stop):
    """A checkpoint at step 2 holds optimizer state for the head only; step 3 adds the blocks."""
    config, tmp = uninterrupted
    split = tmp_path / "run"
    train(config, split, *ONE, f"--train.max_steps={stop}", f"--checkpoint.interval={stop}")
    train(config, split, *ONE)
    assert_bit_exact(config, tmp / "one", split)
    transitions = [r for r in records(split, "params/trainable")]
    assert {r["step"]: r["params/frozen"] for r in transitions}.get(4, 0) == 0


def test_a_two_rank_fsdp2_resume_at_a_transition_is_bit_exact(uninterrupted, tmp_path):
    config, tmp = uninterrupted
    split = tmp_path / "run"
    train(config, split, *FSDP2, "--train.max_steps=2", "--checkpoint.interval=2", ranks=2)
    train(config, split, *FSDP2, ranks=2)
    assert_bit_exact(config, tmp / "two", split)
    # and FSDP2 under the schedule trains as one rank does
    assert_matches((config, tmp / "one"), config, tmp / "two")


def test_the_transitions_are_logged_with_the_parameter_counts(uninterrupted):
    config, tmp = uninterrupted
    logged = {
        r["step"]: (r["params/trainable"], r["params/frozen"])
        for r in records(tmp / "one", "params/trainable")
    }
    embedding = 259 * 32
    total = sum(p.numel() for p in weights(config, tmp / "one", 5).values())
    blocks = total - embedding - 32 - 259 * 32  # less the embedding, final norm and head
    assert logged == {
        1: (total - embedding - blocks, embedding + blocks),
        3: (total - embedding, embedding),
        4: (total, 0),
    }


def test_a_different_schedule_is_refused_naming_the_entries(uninterrupted, tmp_path):
    config, _ = uninterrupted
    run_dir = tmp_path / "run"
    train(config, run_dir, *ONE, "--train.max_steps=2")
    changed = tmp_path / "changed.toml"
    changed.write_text(config.read_text().replace("until_step = 3", "until_step = 4"))
    script = str(REPO / "scripts" / "train.py")
    out = subprocess.run(
        [sys.executable, script, str(changed), f"--run.dir={run_dir}", *COMMON, *ONE],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "different freeze schedule" in out.stderr
    assert (
        "freeze[1]: {'module': 'tok_embeddings', 'frozen': True, 'until_step': 3} → "
        "{'module': 'tok_embeddings', 'frozen': True, 'until_step': 4}" in out.stderr
    )


def test_with_the_override_a_changed_schedule_loads_the_checkpoints_stage(tmp_path, small_corpus):
    """The checkpoint's optimizer holds the head only (blocks frozen under its schedule); the
    new schedule, without that entry, adds the blocks at the next step."""
    config = freeze_config(tmp_path, small_corpus)
    run_dir = tmp_path / "run"
    train(config, run_dir, *ONE, "--train.max_steps=2")
    changed = tmp_path / "changed.toml"
    text = config.read_text()
    changed.write_text(
        text[: text.index("[[freeze]]")] + FREEZE[FREEZE.index('[[freeze]]\nmodule = "tok') :]
    )
    train(config.with_name("changed.toml"), run_dir, *ONE, "--checkpoint.allow_config_change=true")
    logged = {r["step"]: r["params/frozen"] for r in records(run_dir, "params/trainable")}
    assert logged == {1: logged[1], 3: 259 * 32, 4: 0}  # blocks join at 3, the embedding at 4
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4, 5]
