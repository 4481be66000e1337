"""Exit codes are defined once (``forge.types.ExitCode``) and every place that names them
reads that definition: the outcomes, the signal handler, ``--help`` and the docs' table."""

from __future__ import annotations

import re

import pytest

from forge.config.help import EXIT_MEANINGS, help_text
from forge.resilience.signals import ShutdownFlag
from forge.training.loop.outcome import exit_code
from forge.types import ExitCode, LoopOutcome
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (LoopOutcome.COMPLETED, 0),
        (LoopOutcome.ALREADY_COMPLETE, 0),
        (LoopOutcome.DATA_EXHAUSTED, 0),
        (LoopOutcome.NAN_ABORT, 3),
        (LoopOutcome.HEALTH_FAILURE, 4),
        (LoopOutcome.SHUTDOWN, 75),
    ],
)
def test_each_outcome_exits_with_its_documented_code(outcome, code):
    assert exit_code(outcome) == code and isinstance(exit_code(outcome), int)


def test_the_signal_handler_exits_with_the_shutdown_and_interrupt_codes():
    flag = ShutdownFlag()
    assert (flag.exit_code, flag.interrupt_exit_code) == (ExitCode.SHUTDOWN, ExitCode.INTERRUPTED)


def test_help_lists_every_exit_code_with_its_meaning():
    text = help_text()
    assert set(EXIT_MEANINGS) == set(ExitCode)
    for code in ExitCode:
        assert f"{code.value:>3}  {EXIT_MEANINGS[code]}" in text


def test_the_refusals_page_lists_exactly_the_exit_codes():
    page = (REPO / "docs" / "refusals.md").read_text()
    table = page.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    listed = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert listed == {int(code) for code in ExitCode}
