"""JSON-lines record files (``forge.jsonl``): an append after a line a crash cut short starts a
line of its own, so every record file's reader still reads the new record (glued to the cut
line, it was lost with it: a commit start-up checks against, a launch of the ledger)."""

from __future__ import annotations

import json
import pathlib

import pytest

from forge.jsonl import open_byte_lines, open_lines
from forge.metrics.goodput import read_ledger
from forge.metrics.sinks import JsonlSink
from forge.training.loop.ledger import LaunchClock
from forge.training.records.run_records import COMMITS_FILE, last_recorded_commit, record_commit

# (case, the file's bytes before, what it reads after "x" is appended as a line)
APPENDS = [
    ("a file not there yet", None, b"x\n"),
    ("an empty file", b"", b"x\n"),
    ("after a whole line", b'{"a": 1}\n', b'{"a": 1}\nx\n'),
    ("after a line cut short: ended first", b'{"a": 1}\n{"b"', b'{"a": 1}\n{"b"\nx\n'),
]


@pytest.mark.parametrize("before,after", [a[1:] for a in APPENDS], ids=[a[0] for a in APPENDS])
def test_an_append_starts_a_line_of_its_own(tmp_path, before, after):
    for opened, line in ((open_lines, "x\n"), (open_byte_lines, b"x\n")):
        path = tmp_path / f"{opened.__name__}.jsonl"
        if before is not None:
            path.write_bytes(before)
        with opened(path) as f:
            f.write(line)  # type: ignore[arg-type]
        assert path.read_bytes() == after


def test_a_file_that_is_not_regular_is_not_read_before_an_append():
    with open_lines(pathlib.Path("/dev/null")) as f:  # nothing to read: no line to end
        f.write("x\n")


def commits(run_dir: pathlib.Path) -> int | None:
    record_commit(run_dir, 12)
    return last_recorded_commit(run_dir)


def ledger(run_dir: pathlib.Path) -> int | None:
    LaunchClock(run_dir, True, 10.0, clock=lambda: 15.0).loop_begins(step=12, steps_left=True)
    launches = read_ledger(run_dir / "goodput.jsonl", now=1e9)
    return launches[-1].step if launches else None


def metrics(run_dir: pathlib.Path) -> int | None:
    sink = JsonlSink(run_dir / "metrics.jsonl")
    sink.write({"step": 12, "loss": 1.0})
    sink.close()
    steps = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            continue
    return steps[-1]


# (record file, its first line, the writer then reader of a record of step 12)
FILES = [
    (COMMITS_FILE, '{"step": 8, "time": 1.0}', commits),
    ("goodput.jsonl", '{"launch": "1.000-7", "started": 1.0, "wall": 2.0, "step": 8, "uncommitted": 0.0, "ended": true, "seconds": {"productive": 2.0}}', ledger),
    ("metrics.jsonl", '{"step": 8, "loss": 2.0}', metrics),
]  # fmt: skip


@pytest.mark.parametrize("name,first,written", FILES, ids=[f[0] for f in FILES])
def test_a_record_written_after_a_cut_line_is_read(tmp_path, name, first, written):
    (tmp_path / name).write_text(first + "\n" + first[: len(first) // 2])  # killed mid-line
    assert written(tmp_path) == 12
