"""Metrics each rank records with a declared reduction, reduced over every rank together.

A logged step's values are packed into one float64 vector that a single sum over ranks
reduces, whatever metrics the run has: a sum or a mean takes one slot per value; a maximum
and a per-rank gather take ``world`` blocks of its values, one per rank in rank order, each
rank writing its own block (zeros elsewhere), so that the sum *is* the gather. Packing
and unpacking are pure (table-tested); ``forge.parallel.reduce.sum_over_ranks`` makes the
collective. A new logged metric is a ``Recorded`` (and, if it is derived, a ``render``), not
a new reduction.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs


class Reduction(enum.Enum):
    """How a metric's values on every rank become the run's."""

    MEAN = "mean"  # over ranks; ranks that share a data slice (TP peers) hold the same value
    SUM = "sum"  # over ranks
    SLICE_SUM = "slice_sum"  # over data slices: each slice once, however many ranks hold it
    TOKEN_MEAN = "token_mean"  # (sum, count) summed over slices: the sum per count
    MAX = "max"  # over ranks
    GATHER = "gather"  # every rank's values, in rank order

    @property
    def per_rank(self) -> bool:
        """Whether each rank needs a block of slots of its own (``world`` blocks in all)."""
        return self in (Reduction.MAX, Reduction.GATHER)


def as_logged(values: tuple[float, ...]) -> Any:
    """A metric's reduced values as logged: the value of a one-value metric, else the tuple
    (a gather's values in rank order)."""
    return values[0] if len(values) == 1 else values


def width_problem(metric: Recorded, attribute: attrs.Attribute, values: tuple) -> None:
    """A metric records at least one value, and a token mean exactly its (sum, count)."""
    if not values:
        raise ValueError(f"metric {metric.name!r} records no value")
    if metric.reduction is Reduction.TOKEN_MEAN and len(values) != 2:
        raise ValueError(f"metric {metric.name!r}: a token mean records (sum, count)")


@attrs.frozen
class Recorded:
    """One metric as this rank recorded it: its values, their reduction, and how the reduced
    values become the metric (``render``; None: the metric is left out of the record)."""

    name: str
    values: tuple[float, ...] = attrs.field(validator=width_problem)
    reduction: Reduction = attrs.field()
    render: Callable[[tuple[float, ...]], Any] = as_logged

    @property
    def width(self) -> int:
        """The values this rank records."""
        return len(self.values)


def recorded_value(
    name: str,
    value: float,
    reduction: Reduction,
    render: Callable[[tuple[float, ...]], Any] = as_logged,
) -> Recorded:
    """A ``Recorded`` of one value."""
    return Recorded(name, (float(value),), reduction, render)


def nan_max(values: Sequence[float]) -> float:
    """The largest of ``values``, NaN when any is (``max`` would hide it behind a number)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def slots(metric: Recorded, world: int) -> int:
    """The slots ``metric`` takes in the packed vector."""
    return metric.width * world if metric.reduction.per_rank else metric.width


def packed(metrics: Sequence[Recorded], world: int, rank: int) -> list[float]:
    """This rank's contribution to the one sum over ranks: every metric's slots, in order."""
    out: list[float] = []
    for metric in metrics:
        if metric.reduction.per_rank:
            block = [0.0] * slots(metric, world)
            block[rank * metric.width : (rank + 1) * metric.width] = metric.values
            out += block
        else:
            out += metric.values
    return out


def reduced(
    metric: Recorded, sums: Sequence[float], world: int, slices: int
) -> tuple[float, ...] | None:
    """``metric``'s run-wide values from its slots of the summed vector (None: nothing to
    report, a token mean over no tokens). ``slices``: the ranks holding distinct data."""
    kind = metric.reduction
    if kind is Reduction.SUM:
        return tuple(sums)
    if kind is Reduction.MEAN:
        return tuple(v / world for v in sums)
    if kind is Reduction.SLICE_SUM:
        scale = slices / world
        return tuple(v * scale for v in sums)
    if kind is Reduction.TOKEN_MEAN:  # both counted once per slice, as SLICE_SUM
        scale = slices / world
        total, count = sums[0] * scale, sums[1] * scale
        return (total / count,) if count > 0 else None
    if kind is Reduction.MAX:
        per_rank = [sums[r * metric.width : (r + 1) * metric.width] for r in range(world)]
        return tuple(nan_max(column) for column in zip(*per_rank, strict=True))
    return tuple(sums)  # GATHER: rank-major


def chunks(metrics: Sequence[Recorded], sums: Sequence[float], world: int) -> Iterator[list[float]]:
    """Each metric's slots of the summed vector, in order."""
    start = 0
    for metric in metrics:
        size = slots(metric, world)
        yield list(sums[start : start + size])
        start += size
    if start != len(sums):
        raise ValueError(f"{len(sums)} summed values for {start} slots")


def unpacked(
    metrics: Sequence[Recorded], sums: Sequence[float], world: int, slices: int
) -> dict[str, Any]:
    """The record of ``metrics`` from the summed vector: each one rendered from its reduced
    values, those with nothing to report left out."""
    record: dict[str, Any] = {}
    for metric, chunk in zip(metrics, chunks(metrics, sums, world), strict=True):
        values = reduced(metric, chunk, world, slices)
        rendered = None if values is None else metric.render(values)
        if rendered is not None:
            record[metric.name] = rendered
    return record
