"""Metrics recorded with a declared reduction: packed by every rank into one vector, summed
over ranks (here by hand, as the one all-reduce does), unpacked into the run's record."""

from __future__ import annotations

import math

import pytest

from forge.metrics.reduction import Recorded, Reduction, packed, recorded_value, unpacked


def reduce_by_hand(per_rank: list[list[Recorded]], slices: int) -> dict:
    """What ``reduce_metrics`` gives at ``len(per_rank)`` ranks: each rank's packed vector,
    summed element-wise, unpacked with rank 0's metrics."""
    world = len(per_rank)
    vectors = [packed(metrics, world, rank) for rank, metrics in enumerate(per_rank)]
    assert len({len(v) for v in vectors}) == 1, "every rank packs the same slots"
    sums = [math.fsum(column) for column in zip(*vectors, strict=True)]
    return unpacked(per_rank[0], sums, world, slices)


def one(name: str, reduction: Reduction, values: list[float]) -> list[list[Recorded]]:
    return [[recorded_value(name, v, reduction)] for v in values]


@pytest.mark.parametrize(
    ("reduction", "values", "slices", "expected"),
    [
        (Reduction.MEAN, [1.0, 3.0], 2, 2.0),
        (Reduction.MEAN, [5.0], 1, 5.0),
        (Reduction.SUM, [1.0, 3.0, 4.0], 3, 8.0),
        (Reduction.SLICE_SUM, [2.0, 2.0, 6.0, 6.0], 2, 8.0),  # TP peers hold their slice's sum
        (Reduction.SLICE_SUM, [2.0, 6.0], 2, 8.0),
        (Reduction.MAX, [1.0, 7.0, 3.0], 3, 7.0),
        (Reduction.MAX, [-4.0, -2.0], 2, -2.0),  # the zeros of others' slots never win
        (Reduction.MAX, [0.5, math.inf], 2, math.inf),
    ],
    ids=[
        "mean",
        "mean of one rank",
        "sum",
        "slice sum over TP peers",
        "slice sum, one rank per slice",
        "max",
        "max of negatives",
        "max with an infinity",
    ],
)
def test_a_scalar_reduces_as_declared(reduction, values, slices, expected):
    assert reduce_by_hand(one("m", reduction, values), slices) == {"m": expected}


def test_a_gather_keeps_every_rank_in_rank_order():
    per_rank = [[Recorded("t", (float(r), 10.0 * r), Reduction.GATHER, tuple)] for r in range(3)]
    assert reduce_by_hand(per_rank, 3) == {"t": (0.0, 0.0, 1.0, 10.0, 2.0, 20.0)}


@pytest.mark.parametrize(
    ("pairs", "expected"),
    [([(6.0, 4.0), (2.0, 4.0)], {"l": 1.0}), ([(0.0, 0.0), (0.0, 0.0)], {})],
    ids=["sum per token over ranks", "no tokens: left out"],
)
def test_a_token_mean_divides_the_sums_and_is_left_out_without_tokens(pairs, expected):
    per_rank = [[Recorded("l", pair, Reduction.TOKEN_MEAN)] for pair in pairs]
    assert reduce_by_hand(per_rank, 2) == expected


def test_a_nan_on_one_rank_reaches_the_record():
    record = reduce_by_hand(one("m", Reduction.MAX, [1.0, math.nan]), 2)
    assert math.isnan(record["m"])


def test_every_kind_in_one_vector_unpacks_in_order():
    """One vector for all of a step's metrics, whatever their kinds: each finds its slots."""
    per_rank = [
        [
            recorded_value("loss", 2.0 + r, Reduction.MEAN),
            Recorded("loads", (1.0, 2.0), Reduction.SUM, tuple),
            recorded_value("slowest", 0.1 * (r + 1), Reduction.MAX),
            recorded_value("times", 0.1 * (r + 1), Reduction.GATHER, tuple),
            Recorded("src", (3.0, 2.0), Reduction.TOKEN_MEAN),
        ]
        for r in range(2)
    ]
    assert len(packed(per_rank[0], 2, 0)) == 1 + 2 + 2 + 2 + 2
    record = reduce_by_hand(per_rank, 2)
    assert list(record) == ["loss", "loads", "slowest", "times", "src"]
    assert record["loads"] == (2.0, 4.0) and record["times"] == pytest.approx((0.1, 0.2))
    assert (record["loss"], record["src"]) == (2.5, 1.5)
    assert record["slowest"] == pytest.approx(0.2)


def test_a_vector_of_another_length_is_refused():
    metrics = [recorded_value("m", 1.0, Reduction.SUM)]
    with pytest.raises(ValueError, match="2 summed values for 1 slots"):
        unpacked(metrics, [1.0, 2.0], 1, 1)


def test_a_gather_logs_every_rank_without_a_render_of_its_own():
    per_rank = [[recorded_value("t", 0.5 * (r + 1), Reduction.GATHER)] for r in range(3)]
    assert reduce_by_hand(per_rank, 3) == {"t": (0.5, 1.0, 1.5)}


def test_a_token_mean_over_tensor_parallel_peers_scales_both_sums_alike():
    """1 data slice held by 3 TP peers: (3l·s) / (3t·s) with s = 1/3, each sum counted once
    per slice as the tokens logged beside it (3l / 3t differs in the last bit here)."""
    per_rank = [[Recorded("l", (9.56, 4.0), Reduction.TOKEN_MEAN)] for _ in range(3)]
    total, count, scale = math.fsum([9.56] * 3), 12.0, 1 / 3
    assert total / count != (total * scale) / (count * scale)  # a case where it shows
    assert reduce_by_hand(per_rank, 1) == {"l": (total * scale) / (count * scale)}


@pytest.mark.parametrize(
    ("values", "reduction", "message"),
    [
        ((), Reduction.SUM, "records no value"),
        ((1.0,), Reduction.TOKEN_MEAN, "a token mean records"),
        ((1.0, 2.0, 3.0), Reduction.TOKEN_MEAN, "a token mean records"),
    ],
    ids=["no value", "a token mean of one value", "a token mean of three"],
)
def test_a_metric_of_the_wrong_width_is_refused_when_recorded(values, reduction, message):
    with pytest.raises(ValueError, match=message):
        Recorded("m", values, reduction)
