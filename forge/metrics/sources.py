"""Per-source loss and token counts of a data mixture, kept on the training device.

The step adds each micro-batch's per-row sums without a host sync (``SourceStats``, one per
step) and reads them in its one host read, into ``StepResult.sources``; the step logger sums the
steps between two logs and record them for the log's one reduction over ranks
(``source_metrics``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from forge.metrics.reduction import Recorded, Reduction, recorded_value
from forge.types import SourceTotals


class SourceStats:
    """Loss sums and label-token counts per source since the last ``drain``."""

    def __init__(self, names: Sequence[str], device: torch.device | str = "cpu") -> None:
        self.names = tuple(names)
        self.loss = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.tokens = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(self, sources: torch.Tensor, row_loss: torch.Tensor, row_tokens: torch.Tensor) -> None:
        """Accumulate one micro-batch: each row's summed loss and its number of label tokens."""
        self.loss.index_add_(0, sources, row_loss.detach().double())
        self.tokens.index_add_(0, sources, row_tokens.double())

    def drain(self) -> torch.Tensor:
        """``(2, n_sources)``: loss sums and token counts so far; resets both."""
        out = torch.stack([self.loss, self.tokens])
        self.loss = torch.zeros_like(self.loss)
        self.tokens = torch.zeros_like(self.tokens)
        return out


def source_metrics(names: Sequence[str], totals: SourceTotals) -> list[Recorded]:
    """``data/<name>/tokens`` per source (each data slice counted once), and
    ``data/<name>/loss`` (the mean over its tokens) for the sources that had any."""
    metrics: list[Recorded] = []
    for name, loss, tokens in zip(names, totals.loss, totals.tokens, strict=True):
        metrics.append(recorded_value(f"data/{name}/tokens", tokens, Reduction.SLICE_SUM))
        metrics.append(Recorded(f"data/{name}/loss", (loss, tokens), Reduction.TOKEN_MEAN))
    return metrics


def row_record(position: Mapping[str, Any]) -> dict[str, Any]:
    """Sample accounting from the train loader's ``state_dict()``: ``data/rows`` consumed so
    far over every rank, and ``data/rows_digest``, the digest of those rows
    (``forge.data.row_digest``), equal in two runs that consumed the same rows in order."""
    return {"data/rows": position["rows"], "data/rows_digest": position["digest"]}
