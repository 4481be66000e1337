"""The goodput ledger of a real run across launches: a SIGKILL, a SIGTERM, then the end."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from forge.metrics.goodput import Bucket, read_ledger, run_totals, run_wall
from tests.e2e.sandbox import train
from tests.e2e.test_train_script import load_script
from tests.in_process import run_main

GOODPUT = load_script("goodput")


def test_a_run_with_two_restarts_accounts_for_its_wall_time(sandbox):
    """Killed at step 7 (checkpoint at 5), stopped by SIGTERM after step 9 (saved at 10),
    then completed: three launches in the ledger, the killed one's line kept as it last wrote
    it, the steps it trained past its commit counted as recomputed, and the buckets adding up
    to the run's wall time within 5%."""
    killed = train(sandbox, env={"FORGE_FAULTS": "signal:step=7:sig=KILL"})
    assert killed.code == -9, killed.stderr
    stopped = train(sandbox, env={"FORGE_FAULTS": "signal:step=9:sig=TERM"})
    assert stopped.code == 75, stopped.stderr
    done = train(sandbox)
    assert done.code == 0, done.stderr
    launches = read_ledger(sandbox.dir / "goodput.jsonl")
    assert [(r.step, r.ended) for r in launches] == [(7, False), (10, True), (12, True)]
    first = launches[0]
    assert first.uncommitted > 0  # steps 6 and 7, past the checkpoint of step 5
    assert launches[1].uncommitted == launches[2].uncommitted == 0  # each ended with a save
    totals = run_totals(launches)
    assert totals[Bucket.RECOMPUTED] >= first.uncommitted
    assert totals[Bucket.DOWN] > 0  # between the kill and the next launch
    wall = run_wall(launches)
    assert abs(sum(totals.values()) - wall) <= 0.05 * wall, (totals, wall)
    assert all(
        totals[b] > 0
        for b in (Bucket.IMPORTS, Bucket.SETUP, Bucket.PRODUCTIVE, Bucket.CHECKPOINT, Bucket.VERIFY)
    )
    summary = [x for x in done.stderr.splitlines() if x.startswith("[forge] goodput ")]
    assert len(summary) == 1 and "over 3 launches" in summary[0], done.stderr
    records = [json.loads(x) for x in (sandbox.dir / "metrics.jsonl").read_text().splitlines()]
    ledgers = [r for r in records if "goodput" in r]
    assert ledgers[-1]["step"] == 12 and 0 < ledgers[-1]["goodput"] < 1
    # the script that reads a run: a row per launch, the buckets, the summary
    report = run_main(GOODPUT.main, [str(sandbox.dir)])
    assert report.returncode == 0
    rows = report.stdout.splitlines()
    assert [r.split()[1] for r in rows[:3]] == ["1", "2", "3"] and "killed" in rows[0]
    assert rows[-1] == summary[0].removeprefix("[forge] ")


def test_the_reader_calls_a_launch_that_holds_the_run_running_not_killed(tmp_path):
    """A trainer holds the run's lock: its last line (not ended) is a launch still running,
    whose steps past its last save are not lost yet; once the lock is gone, it was killed."""
    import fcntl
    import time

    from forge.metrics.goodput import LaunchRecord, launch_line
    from forge.training.records.run_dir import LOCK_FILE

    now = time.time()
    done = LaunchRecord("a", now - 100, 50, 10, 0.0, True, {"productive": 40, "setup": 10})
    live = LaunchRecord("b-4242", now - 40, 30, 14, 5.0, False, {"productive": 25, "setup": 5})
    (tmp_path / "goodput.jsonl").write_text(launch_line(done) + launch_line(live))
    with (tmp_path / LOCK_FILE).open("w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        lock.write("pid 4242 on host h\n")
        lock.flush()
        held = run_main(GOODPUT.main, [str(tmp_path)])
        lock.seek(0)
        lock.truncate()
        lock.write("pid 5151 on host h\n")  # a launch still loading: the last line is not its
        lock.flush()
        loading = run_main(GOODPUT.main, [str(tmp_path)])
    after = run_main(GOODPUT.main, [str(tmp_path)])
    assert held.returncode == after.returncode == loading.returncode == 0
    assert "running:" in held.stdout.splitlines()[1] and "killed" not in held.stdout
    assert "killed" in loading.stdout.splitlines()[1]
    assert "killed (5.0 s past its last save lost)" in after.stdout.splitlines()[1]
    recomputed = [line for line in held.stdout.splitlines() if line.startswith("recomputed")]
    assert recomputed[0].split()[1] == "0.0", held.stdout  # not lost while it runs


def fifo(path: pathlib.Path) -> None:
    os.mkfifo(path)


# (case, how the ledger is made, the error's words after its path)
UNREADABLE = [
    ("no regular file", fifo, "not a regular file"),
    ("empty", lambda path: path.write_bytes(b""), "no line of it is a launch's record"),
    ("nothing but damage", lambda path: path.write_bytes(bytes(range(256)) * 2), "no line of it is a launch's record"),
]  # fmt: skip


@pytest.mark.parametrize("make,words", [u[1:] for u in UNREADABLE], ids=[u[0] for u in UNREADABLE])
def test_the_reader_refuses_a_ledger_that_holds_no_record(tmp_path, make, words):
    """Read as no launch, it used to say `goodput 0.00 over 0 launches`, exit 0."""
    make(tmp_path / "goodput.jsonl")
    out = run_main(GOODPUT.main, [str(tmp_path)])
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: {tmp_path / 'goodput.jsonl'}: {words}")


def test_the_reader_says_how_many_lines_it_passed_over(tmp_path):
    from forge.metrics.goodput import LaunchRecord, launch_line

    done = LaunchRecord("a", 100.0, 50, 10, 0.0, True, {"productive": 40, "setup": 10})
    (tmp_path / "goodput.jsonl").write_text(launch_line(done) + "{torn\n" + "[]\n")
    out = run_main(GOODPUT.main, [str(tmp_path)])
    assert out.returncode == 0
    assert "over 1 launch" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("(2 lines of ")
