"""Per-source loss and token sums: accumulated without syncing, reported per source."""

import pytest
import torch

from forge.metrics.sources import SourceStats, source_record


def test_rows_add_to_their_source_and_drain_resets():
    stats = SourceStats(["a", "b", "c"])
    stats.add(torch.tensor([0, 1, 0]), torch.tensor([2.0, 9.0, 4.0]), torch.tensor([2, 3, 2]))
    stats.add(torch.tensor([1]), torch.tensor([3.0]), torch.tensor([1]))
    sums = stats.drain()
    assert sums.tolist() == [[6.0, 12.0, 0.0], [4.0, 4.0, 0.0]]
    assert stats.drain().sum() == 0


@pytest.mark.parametrize(
    ("sums", "expected"),
    [
        (
            [[6.0, 12.0], [4.0, 4.0]],
            {"data/a/tokens": 4.0, "data/a/loss": 1.5, "data/b/tokens": 4.0, "data/b/loss": 3.0},
        ),
        (
            [[6.0, 0.0], [4.0, 0.0]],
            {"data/a/tokens": 4.0, "data/a/loss": 1.5, "data/b/tokens": 0.0},
        ),
    ],
    ids=["both sources", "a source with no tokens has no loss"],
)
def test_source_record(sums, expected):
    assert source_record(["a", "b"], sums) == expected
