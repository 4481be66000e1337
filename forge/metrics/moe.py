"""The ``moe/*`` metrics of a mixture-of-experts model, from a step's statistics reduced
over ranks (pure: table-tested)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from forge.types import MoeStepStats


def load_cv(loads: Sequence[float]) -> float:
    """std / mean of the tokens each expert received (0 when perfectly balanced, 0 when no
    token was routed at all)."""
    mean = sum(loads) / len(loads)
    if mean <= 0:
        return 0.0
    variance = sum((x - mean) ** 2 for x in loads) / len(loads)
    return math.sqrt(variance) / mean


def moe_record(stats: MoeStepStats, ranks: int = 1) -> dict[str, Any]:
    """``moe/aux_loss`` and ``moe/z_loss`` (means per MoE layer, ``stats`` holding the sum
    over ``ranks`` ranks), ``moe/dropped_fraction`` (assignments dropped by capacity) and
    ``moe/load_cv`` (the load's coefficient of variation, averaged over MoE layers)."""
    return {
        "moe/aux_loss": stats.aux_loss / ranks,
        "moe/z_loss": stats.z_loss / ranks,
        "moe/dropped_fraction": stats.dropped / stats.assigned if stats.assigned else 0.0,
        "moe/load_cv": sum(load_cv(layer) for layer in stats.loads) / len(stats.loads),
    }
