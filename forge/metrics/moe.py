"""The ``moe/*`` metrics of a mixture-of-experts model: a step's statistics on this rank,
recorded with their reductions over ranks (pure: table-tested)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from forge.metrics.reduction import Recorded, Reduction, recorded_value
from forge.types import MoeStepStats


def load_cv(loads: Sequence[float]) -> float:
    """std / mean of the tokens each expert received (0 when perfectly balanced, 0 when no
    token was routed at all)."""
    mean = sum(loads) / len(loads)
    if mean <= 0:
        return 0.0
    variance = sum((x - mean) ** 2 for x in loads) / len(loads)
    return math.sqrt(variance) / mean


def dropped_fraction(sums: tuple[float, ...]) -> float:
    """Assignments dropped by capacity per assignment made (0 when none was made)."""
    dropped, assigned = sums
    return dropped / assigned if assigned else 0.0


def mean_load_cv(n_experts: int, loads: tuple[float, ...]) -> float:
    """``load_cv`` of each MoE layer's summed loads (``n_experts`` per layer), averaged."""
    layers = [loads[i : i + n_experts] for i in range(0, len(loads), n_experts)]
    return sum(load_cv(layer) for layer in layers) / len(layers)


def moe_metrics(stats: MoeStepStats) -> list[Recorded]:
    """``moe/aux_loss`` and ``moe/z_loss`` (means per MoE layer, averaged over ranks),
    ``moe/dropped_fraction`` (assignments dropped by capacity, over every rank) and
    ``moe/load_cv`` (the coefficient of variation of the load summed over ranks, averaged
    over MoE layers)."""
    loads = tuple(v for layer in stats.loads for v in layer)
    return [
        recorded_value("moe/aux_loss", stats.aux_loss, Reduction.MEAN),
        recorded_value("moe/z_loss", stats.z_loss, Reduction.MEAN),
        Recorded(
            "moe/dropped_fraction", (stats.dropped, stats.assigned), Reduction.SUM, dropped_fraction
        ),
        Recorded(
            "moe/load_cv",
            loads,
            Reduction.SUM,
            functools.partial(mean_load_cv, len(stats.loads[0])),
        ),
    ]
