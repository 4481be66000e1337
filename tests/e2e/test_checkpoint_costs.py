"""What checkpoints cost, in the metrics: each committed save's time the loop was held, the
time until its commit and its bytes; each resume's load and verification time."""

from __future__ import annotations

import json
import math

import pytest

from tests.e2e.test_train_script import TRAIN, SignalAt, run_dir

SAVE_KEYS = ("checkpoint/blocked_s", "checkpoint/commit_s", "checkpoint/bytes")


def cost_records(config, key):
    lines = (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


def recorded_bytes(config, step):
    """The bytes of the files the ranks wrote, as the commit's ``checksums.json`` lists them
    (the train state, written by the commit itself, aside)."""
    sums = run_dir(config) / "checkpoints" / f"step_{step}" / "checksums.json"
    files = json.loads(sums.read_text())["files"]
    return sum(int(entry[0]) for name, entry in files.items() if name != "train_state.json")


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_every_committed_save_records_its_cost(tiny_config, mode):
    assert TRAIN.main([str(tiny_config), f"--checkpoint.async_mode={mode}"]) == 0
    saves = cost_records(tiny_config, "checkpoint/commit_s")
    assert [r["step"] for r in saves] == [5, 10, 12]  # every 5 steps, and the final one
    for record in saves:
        assert set(SAVE_KEYS) <= record.keys()
        assert all(math.isfinite(record[k]) and record[k] > 0 for k in SAVE_KEYS)
        # the longest any rank was held is part of the time until the commit
        assert record["checkpoint/blocked_s"] <= record["checkpoint/commit_s"] * 1.5 + 0.05
        assert record["checkpoint/bytes"] == recorded_bytes(tiny_config, record["step"])


def test_a_resume_records_its_load_and_verification(tiny_config):
    assert TRAIN.main([str(tiny_config)], hooks=[SignalAt(6)]) == 75  # saves step 7
    assert cost_records(tiny_config, "checkpoint/load_s") == []  # a fresh start loads nothing
    assert TRAIN.main([str(tiny_config)]) == 0
    (resume,) = cost_records(tiny_config, "checkpoint/load_s")
    assert resume["step"] == 7
    assert resume["checkpoint/load_s"] > 0 and resume["checkpoint/verify_s"] > 0


def test_an_already_complete_run_records_nothing(tiny_config):
    assert TRAIN.main([str(tiny_config)]) == 0
    before = (run_dir(tiny_config) / "metrics.jsonl").read_bytes()
    assert TRAIN.main([str(tiny_config)]) == 0
    assert (run_dir(tiny_config) / "metrics.jsonl").read_bytes() == before
