"""The goodput ledger's arithmetic (pure): launches added up, lost work, the gaps between."""

from __future__ import annotations

import pytest

from forge.metrics.goodput import (
    Bucket,
    LaunchRecord,
    goodput,
    launch_line,
    read_ledger,
    run_totals,
    run_wall,
    summary_line,
)


def launch(
    started, wall, seconds, uncommitted=0.0, ended=True, name=None, replicated=False,
    completed=False,
):  # fmt: skip
    return LaunchRecord(
        launch=name or f"{started}", started=started, wall=wall, step=10,
        uncommitted=uncommitted, ended=ended, seconds=seconds, replicated=replicated,
        completed=completed,
    )  # fmt: skip


P, S, C = Bucket.PRODUCTIVE.value, Bucket.SETUP.value, Bucket.CHECKPOINT.value

# (case, launches, expected totals of the buckets named)
ROWS = [
    ("one clean launch", [launch(0, 10, {S: 2, P: 7, C: 1})], {Bucket.PRODUCTIVE: 7, Bucket.DOWN: 0}),
    (
        "a killed launch's work past its last commit is recomputed",
        [launch(0, 10, {S: 2, P: 8}, uncommitted=3, ended=False), launch(12, 10, {S: 2, P: 8})],
        {Bucket.PRODUCTIVE: 13, Bucket.RECOMPUTED: 3, Bucket.DOWN: 2, Bucket.SETUP: 4},
    ),
    (
        "a killed replica group's work past its last save was kept by its peers",
        [launch(0, 10, {S: 2, P: 8}, uncommitted=3, ended=False, replicated=True), launch(12, 10, {S: 2, P: 8}, replicated=True)],
        {Bucket.PRODUCTIVE: 16, Bucket.RECOMPUTED: 0, Bucket.DOWN: 2},
    ),
    (
        "a launch stopped with a save lost nothing",
        [launch(0, 10, {S: 2, P: 8}), launch(10.5, 5, {S: 1, P: 4})],
        {Bucket.PRODUCTIVE: 12, Bucket.RECOMPUTED: 0, Bucket.DOWN: 0.5},
    ),
    (
        "a completed run extended a week later: the week is not the run's",
        [launch(0, 10, {P: 10}, completed=True), launch(604800, 5, {S: 1, P: 4})],
        {Bucket.DOWN: 0, Bucket.PRODUCTIVE: 14},
    ),
    (
        "a finished run that saved nothing (checkpointing off) lost nothing",
        [launch(0, 10, {S: 2, P: 8}, uncommitted=8, completed=True)],
        {Bucket.PRODUCTIVE: 8, Bucket.RECOMPUTED: 0},
    ),
    (
        "a run stopped (not complete) and relaunched later: the wait is down",
        [launch(0, 10, {P: 10}), launch(100, 5, {S: 1, P: 4})],
        {Bucket.DOWN: 90},
    ),
    (
        "overlapping launches (a clock step back) add no negative gap",
        [launch(0, 10, {P: 10}), launch(9, 5, {P: 5})],
        {Bucket.DOWN: 0},
    ),
]  # fmt: skip


@pytest.mark.parametrize("launches,expected", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_run_totals(launches, expected):
    totals = run_totals(launches)
    for bucket, seconds in expected.items():
        assert totals[bucket] == pytest.approx(seconds), bucket


@pytest.mark.parametrize(
    "launches,wall",
    [
        ([launch(0, 10, {S: 2, P: 8}, 3, False), launch(12, 10, {S: 2, P: 8})], 22),
        ([launch(0, 10, {S: 2, P: 8}, completed=True), launch(500, 10, {S: 2, P: 8}), launch(515, 5, {P: 5})], 30),
    ],
    ids=["killed, then relaunched", "completed, extended later, then stopped and relaunched"],
)  # fmt: skip
def test_the_buckets_of_fully_timed_launches_add_up_to_the_run_wall(launches, wall):
    assert sum(run_totals(launches).values()) == pytest.approx(run_wall(launches)) == wall


def test_goodput_is_productive_over_the_wall():
    launches = [launch(0, 10, {S: 2, P: 8}, 3, False), launch(12, 10, {S: 2, P: 8})]
    assert goodput(run_totals(launches)) == pytest.approx(13 / 22)


def test_the_ledger_keeps_each_launchs_last_line_and_passes_over_a_torn_one(tmp_path):
    path = tmp_path / "goodput.jsonl"
    first = launch(0, 5, {P: 4}, name="a")
    later = launch(0, 9, {P: 8}, name="a")
    other = launch(10, 3, {P: 2}, name="b")
    path.write_text(
        launch_line(first) + launch_line(later) + launch_line(other) + '{"launch": "b", "wa'
    )
    assert read_ledger(path) == [later, other]
    assert read_ledger(tmp_path / "none.jsonl") == []


def test_the_summary_names_goodput_and_the_largest_buckets_first():
    line = summary_line(run_totals([launch(0, 10, {S: 2, P: 7, C: 1})]), 1)
    assert (
        line
        == "goodput 0.70 over 1 launch, 10.0 s: productive 7.0 s, setup 2.0 s, checkpoint 1.0 s"
    )


# (case, a line as a damaged or hand-edited file may hold it)
DAMAGED = [
    ("a bucket no launch writes", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": {"startup": 1}}'),
    ("a NaN", '{"launch": "c", "started": 20, "wall": NaN, "step": 1, "uncommitted": 0, "ended": true, "seconds": {}}'),
    ("an infinity in a bucket", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": {"setup": Infinity}}'),
    ("a string for a number", '{"launch": "c", "started": "20", "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": {}}'),
    ("a string for completed", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": {}, "completed": 1}'),
    ("a string for replicated", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": {}, "replicated": "yes"}'),
    ("a missing field", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "ended": true, "seconds": {}}'),
    ("seconds that are a list", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": [1]}'),
    ("a JSON value that is no object", "[1, 2]"),
    ("an integer too large for a float", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": {"productive": 10000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000}}'),
    ("negative seconds", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": {"productive": -500}}'),
    ("a negative wall", '{"launch": "c", "started": 20, "wall": -5000, "step": 1, "uncommitted": 0, "ended": true, "seconds": {}}'),
    ("more lost than trained", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 50, "ended": true, "seconds": {"productive": 1}}'),
    ("a string for ended", '{"launch": "c", "started": 20, "wall": 1, "step": 1, "uncommitted": 0, "ended": "no", "seconds": {}}'),
    ("a negative step", '{"launch": "c", "started": 20, "wall": 1, "step": -1, "uncommitted": 0, "ended": true, "seconds": {}}'),
    ("a line that ends a day after it is read", '{"launch": "c", "started": 86420, "wall": 1, "step": 1, "uncommitted": 0, "ended": true, "seconds": {}}'),
]  # fmt: skip


@pytest.mark.parametrize("line", [d[1] for d in DAMAGED], ids=[d[0] for d in DAMAGED])
def test_a_damaged_line_is_passed_over_and_the_rest_added_up(tmp_path, line):
    path = tmp_path / "goodput.jsonl"
    good = launch(0, 10, {P: 8, S: 2}, name="a")
    path.write_text(launch_line(good) + line + "\n")
    assert read_ledger(path, now=30) == [good]
    assert sum(run_totals(read_ledger(path, now=30)).values()) == 10


def test_a_ledger_that_is_no_regular_file_reads_as_empty_without_blocking(tmp_path):
    import os

    os.mkfifo(tmp_path / "goodput.jsonl")  # opened for reading, it would wait for a writer
    assert read_ledger(tmp_path / "goodput.jsonl") == []
