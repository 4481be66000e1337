"""``metrics.jsonl`` on resume: records past the resumed step, and lines that are no record,
are dropped; the rest is kept as written."""

from __future__ import annotations

import json

import pytest

from forge.metrics.sinks import sink_failure, superseded_path, trim_records_after
from forge.training.loop.outcome import log_failure_line
from forge.training.records.run_records import (
    ConfigRecord,
    config_record,
    unrecorded_configs_note,
    write_run_records,
)
from forge.types import LoopOutcome


def line(step: int) -> bytes:
    return json.dumps({"step": step, "loss": 1.0}).encode()


# (case, the file's lines, lines dropped, steps kept)
CASES = [
    ("nothing past the step", [line(1), line(2)], 0, [1, 2]),
    ("records past the step", [line(1), line(2), line(3), line(4)], 2, [1, 2]),
    ("a torn last line", [line(1), line(2), b'{"step": 3, "lo'], 1, [1, 2]),
    ("a line of bytes that are not UTF-8", [line(1), b"\xff\xfe{", line(2)], 1, [1, 2]),
    ("a JSON value that is no record", [line(1), b"[1, 2]", b"7", line(2)], 2, [1, 2]),
    ("blank lines", [line(1), b"", b"  ", line(2)], 0, [1, 2]),
]


@pytest.mark.parametrize(
    ("lines", "dropped", "kept"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_resume_keeps_the_records_up_to_its_step(tmp_path, lines, dropped, kept):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    before = [x for x in lines if x.strip()]
    assert trim_records_after(path, 2) == dropped
    assert [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()] == kept
    # nothing is lost: what was taken out is kept, byte for byte, in the superseded file
    archive = superseded_path(path)
    taken = archive.read_bytes().splitlines() if archive.exists() else []
    assert len(taken) == dropped
    remaining = [x for x in path.read_bytes().splitlines() if x.strip()]
    assert sorted(taken + remaining) == sorted(before)


def test_records_taken_out_twice_are_both_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(line(1) + b"\n" + line(2) + b"\n" + line(3) + b"\n")
    trim_records_after(path, 2)
    path.write_bytes(path.read_bytes() + line(3) + b"\n")
    trim_records_after(path, 1)
    steps = [json.loads(x)["step"] for x in superseded_path(path).read_text().splitlines()]
    assert steps == [3, 2, 3]


def test_a_missing_file_is_nothing_to_trim(tmp_path):
    assert trim_records_after(tmp_path / "metrics.jsonl", 5) == 0


# (case, recorded configs by step, the start's step, its config, file written, files dropped)
CONFIG_CASES = [
    ("a fresh run", {}, 0, "A", "config.toml", ()),
    ("a fresh restart, same config", {0: "A"}, 0, "A", None, ()),
    ("a fresh restart, another config", {0: "A"}, 0, "B", "config.toml", ()),
    ("a resume, unchanged", {0: "A"}, 10, "A", None, ()),
    ("a resume with a change", {0: "A"}, 10, "B", "config.step_10.toml", ()),
    ("a second change", {0: "A", 10: "B"}, 20, "C", "config.step_20.toml", ()),
    ("a resume back to the original", {0: "A", 10: "B"}, 20, "A", "config.step_20.toml", ()),
    ("a resume under the newest", {0: "A", 10: "B"}, 20, "B", None, ()),
    ("a resume at the step of the newest, changed", {0: "A", 10: "B"}, 10, "C", "config.step_10.toml", ()),
    ("a resume before a discarded change", {0: "A", 30: "B"}, 20, "A", None, ("config.step_30.toml",)),
    ("a resume before it, changed", {0: "A", 30: "B"}, 20, "C", "config.step_20.toml", ("config.step_30.toml",)),
    ("a run whose config.toml is gone", {10: "B"}, 20, "B", None, ()),
    ("a resume whose every config is gone", {}, 10, "A", "config.step_10.toml", ()),
    ("... but a discarded change's", {30: "B"}, 20, "A", "config.step_20.toml", ("config.step_30.toml",)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("recorded", "step", "text", "write", "drop"),
    [c[1:] for c in CONFIG_CASES],
    ids=[c[0] for c in CONFIG_CASES],
)
def test_a_start_records_its_config_only_when_it_differs_from_the_one_in_force(
    recorded, step, text, write, drop
):
    assert config_record(recorded, step, text) == ConfigRecord(write, drop)


# (recorded configs' steps, the start's step, the last step recorded nowhere (None: no
# warning), whether this launch's config is recorded as config.step_N.toml for want of one)
UNRECORDED = [((), 0, None, False), ((0,), 10, None, False), ((0, 10), 20, None, False),
              ((10,), 20, 10, False), ((), 10, 10, True), ((30,), 20, 20, True),
              ((20,), 20, 20, False)]  # fmt: skip


@pytest.mark.parametrize(("recorded", "step", "last", "recorded_now"), UNRECORDED)
def test_a_resume_says_which_first_steps_have_no_recorded_config(
    recorded, step, last, recorded_now
):
    note = unrecorded_configs_note(recorded, step)
    assert (note is not None) == (last is not None)
    if note is not None:
        assert f"steps 1-{last} is recorded nowhere" in note
        assert (f"config.step_{step}.toml" in note) is recorded_now


class Failing:
    config_key = "metrics.jsonl"
    path = "runs/x/metrics.jsonl"


class Console:
    pass


def test_a_metrics_file_that_cannot_be_written_stops_the_run_and_the_console_does_not():
    full = OSError(28, "No space left on device")
    failure = sink_failure(Failing(), full, 7)  # type: ignore[arg-type]
    assert failure == (
        "metrics.jsonl: cannot write runs/x/metrics.jsonl (No space left on device): the "
        "records from step 7 on are lost"
    )
    assert sink_failure(Console(), full, 7) is None  # type: ignore[arg-type]


# (outcome, checkpointing, what the line says after the failure)
ENDINGS = [
    (LoopOutcome.SHUTDOWN, True, "the run stopped at step 8 with a checkpoint: free space"),
    (LoopOutcome.SHUTDOWN, False, "the run stopped at step 8: free space"),
    (LoopOutcome.COMPLETED, True, "the run ended completed at step 8: free space"),
    (LoopOutcome.NAN_ABORT, True, "the run ended nan_abort at step 8: free space"),
]


@pytest.mark.parametrize("outcome,checkpointing,said", ENDINGS)
def test_a_lost_record_is_reported_by_how_the_run_ended(outcome, checkpointing, said):
    line = log_failure_line("metrics.jsonl: cannot write x (E)", outcome, 8, checkpointing)
    assert line.startswith("metrics.jsonl: cannot write x (E); ") and said in line
    assert ("run again to resume" in line) is (outcome is LoopOutcome.SHUTDOWN)


def test_a_recorded_config_that_cannot_be_read_is_named_and_nothing_is_written(tmp_path):
    (tmp_path / "config.toml").write_bytes(b"[model]\ndim = \xff\n")
    (tmp_path / "metrics.jsonl").write_bytes(line(1) + b"\n" + line(2) + b"\n")
    problem = write_run_records(tmp_path, tmp_path / "metrics.jsonl", 1, "[model]\n")
    assert problem is not None and problem.startswith(
        f"run.dir: cannot read {tmp_path}/config.toml"
    )
    assert (tmp_path / "metrics.jsonl").read_bytes().count(b"\n") == 2  # not trimmed either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml", "metrics.jsonl"]
