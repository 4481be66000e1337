"""The scripts' shared command-line pieces (forge/cli.py)."""

from __future__ import annotations

import pytest

from forge.cli import summary

# (a script's docstring, its one-line description)
SUMMARIES = [
    ("Train a model.\n\nMore words.", "Train a model."),
    ("\n  Leading blank line.\nsecond", "Leading blank line."),
    (None, ""),  # python -OO strips docstrings
    ("", ""),
    ("   \n ", ""),
]


@pytest.mark.parametrize("doc,expected", SUMMARIES)
def test_a_description_is_the_docstrings_first_line_or_nothing(doc, expected):
    assert summary(doc) == expected
