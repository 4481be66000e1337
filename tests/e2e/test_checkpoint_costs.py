"""What checkpoints cost, in the metrics: each committed save's time the loop was held, the
time until its commit and its bytes ride in the next logged record; a resume's load and
verification time in the first."""

from __future__ import annotations

import json
import math

import pytest

from tests.e2e.test_train_script import TRAIN, SignalAt, run_dir

SAVE_KEYS = ("checkpoint/blocked_s", "checkpoint/commit_s", "checkpoint/bytes")


def records_with(config, key):
    lines = (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


def recorded_bytes(config, step):
    """The bytes of the files the ranks wrote, as the commit's ``checksums.json`` lists them
    (the train state, written by the commit itself, aside)."""
    sums = run_dir(config) / "checkpoints" / f"step_{step}" / "checksums.json"
    files = json.loads(sums.read_text())["files"]
    return sum(int(entry[0]) for name, entry in files.items() if name != "train_state.json")


# (async mode, {logged step: the save whose costs it carries}): saves every 5 steps and a
# final one at 12; a synchronous save commits at once, an async one once every rank has
# written it (at a step its write outran, by the save of step 10 at the latest: the step it
# rides in depends on the machine, its bounds do not); the final save commits after the
# last log
CARRIED = [("disabled", {6: 5, 11: 10}), ("async", None)]


@pytest.mark.parametrize(("mode", "carried"), CARRIED, ids=[c[0] for c in CARRIED])
def test_a_committed_save_s_costs_ride_in_the_next_logged_record(tiny_config, mode, carried):
    assert TRAIN.main([str(tiny_config), f"--checkpoint.async_mode={mode}"]) == 0
    saves = records_with(tiny_config, "checkpoint/step")
    if carried is not None:
        assert {r["step"]: r["checkpoint/step"] for r in saves} == carried
    else:
        assert 5 in {r["checkpoint/step"] for r in saves}
        assert all(r["checkpoint/step"] < r["step"] <= r["checkpoint/step"] + 6 for r in saves)
    for record in saves:
        assert all(math.isfinite(record[k]) and record[k] > 0 for k in SAVE_KEYS)
        assert record["checkpoint/blocked_s"] <= record["checkpoint/commit_s"]
        assert record["checkpoint/bytes"] == recorded_bytes(tiny_config, record["checkpoint/step"])
        assert "loss" in record  # in the step's own record: one record per logged step


def test_a_resume_records_its_load_and_verification_in_the_first_record(tiny_config):
    assert TRAIN.main([str(tiny_config)], hooks=[SignalAt(6)]) == 75  # saves step 7
    assert records_with(tiny_config, "checkpoint/load_s") == []  # a fresh start loads nothing
    assert TRAIN.main([str(tiny_config)]) == 0
    (resume,) = records_with(tiny_config, "checkpoint/load_s")
    assert resume["step"] == 8 and "loss" in resume
    assert resume["checkpoint/load_s"] > 0 and resume["checkpoint/verify_s"] > 0
