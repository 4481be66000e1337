"""``metrics.jsonl`` on resume: records past the resumed step, and lines that are no record,
are dropped; the rest is kept as written."""

from __future__ import annotations

import json

import pytest

from forge.metrics.sinks import trim_records_after


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
    assert trim_records_after(path, 2) == dropped
    assert [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()] == kept


def test_a_missing_file_is_nothing_to_trim(tmp_path):
    assert trim_records_after(tmp_path / "metrics.jsonl", 5) == 0
