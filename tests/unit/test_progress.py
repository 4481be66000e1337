"""The console output: a progress line on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

import pytest

from forge.metrics.sinks import (
    ProgressSink,
    StdoutSink,
    console_sink,
    format_duration,
    progress_line,
)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"),
        (44.6, "45s"),
        (60, "1m00s"),
        (192, "3m12s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (7500, "2h05m"),
        (float("nan"), "?"),  # no step time measured yet
        (float("inf"), "?"),
        (-1, "?"),
    ],
)
def test_durations_are_short(seconds, shown):
    assert format_duration(seconds) == shown


STEP = {"step": 120, "loss": 2.34561, "tokens_per_sec": 5120.4, "step_time": 0.6, "lr": 1e-3}


def test_progress_line_shows_step_loss_rate_and_eta():
    # 280 steps left at 0.6 s each
    assert progress_line(STEP, 400) == "step 120/400 | loss 2.3456 | 5,120 tok/s | ETA 2m48s"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_line_rewritten_in_place():
    out = Terminal()
    sink = ProgressSink(out, 400)
    sink.write(STEP)
    sink.write(STEP | {"step": 121})
    assert "\n" not in out.getvalue()  # both on one line
    assert out.getvalue().count("\r") == 2
    sink.write({"step": 121, "eval/loss": 2.0})  # an eval record gets its own line
    sink.close()
    lines = out.getvalue().split("\n")
    assert "eval/loss 2" in lines[0] and lines[-1] == ""


@pytest.mark.parametrize(
    ("stream", "kind"), [(Terminal(), ProgressSink), (io.StringIO(), StdoutSink)]
)
def test_plain_lines_when_not_a_terminal(stream, kind):
    """SLURM logs and pipes keep one greppable line per logged step."""
    assert isinstance(console_sink(stream, 10), kind)
