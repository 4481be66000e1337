"""Fixtures of the end-to-end tests that break things: a trained run to copy, a sandbox."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.sandbox import Run, make_run, train_here


@pytest.fixture(scope="session")
def trained(tmp_path_factory, small_corpus) -> Run:
    """A tiny run trained to step 10, checkpoints at 5 and 10: copied by the rows that resume."""
    root = tmp_path_factory.mktemp("trained")
    run = make_run(root, small_corpus)
    result = train_here(run, "--train.max_steps=10")
    assert result.code == 0, result.stderr
    return run


@pytest.fixture
def sandbox(tmp_path, small_corpus) -> Run:
    """A fresh run with its own copy of the data, nothing trained."""
    data = tmp_path / "data"
    shutil.copytree(small_corpus, data)
    return make_run(tmp_path, data)
