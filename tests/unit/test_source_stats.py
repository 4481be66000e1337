"""Per-source loss and token sums: accumulated without syncing, reported per source."""

import pytest
import torch

from forge.metrics.reduction import packed, unpacked
from forge.metrics.sources import SourceStats, source_metrics
from forge.types import SourceTotals


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
def test_source_metrics(sums, expected):
    metrics = source_metrics(["a", "b"], SourceTotals(tuple(sums[0]), tuple(sums[1])))
    assert unpacked(metrics, packed(metrics, 1, 0), world=1, slices=1) == expected


def test_tensor_parallel_peers_count_their_slice_once():
    """4 ranks as 2 data slices × 2 TP peers: every peer holds its slice's sums."""
    slices = [SourceTotals((6.0,), (4.0,)), SourceTotals((2.0,), (4.0,))]
    ranks = [source_metrics(["a"], slices[r // 2]) for r in range(4)]
    sums = [sum(v) for v in zip(*(packed(m, 4, r) for r, m in enumerate(ranks)), strict=True)]
    assert unpacked(ranks[0], sums, world=4, slices=2) == {"data/a/tokens": 8.0, "data/a/loss": 1.0}
