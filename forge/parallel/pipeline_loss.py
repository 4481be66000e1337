"""The last pipeline stage's loss function: what ``micro_batch_loss`` computes outside a
pipeline (cross-entropy, z-loss, a mixture of experts' auxiliary losses, the multi-token
depths' losses), weighed so that every label of the step counts the same."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from forge.data.packing import IGNORE_INDEX
from forge.metrics.sources import SourceStats
from forge.model.chunked_loss import PLAIN_LOSS, LossSpec
from forge.model.moe import moe_terms
from forge.model.mtp import split_mtp_output
from forge.model.transformer import split_moe_output


@attrs.frozen
class MicroRecord:
    """One micro-batch as the last stage saw it, for the step to log: its mean cross-entropy,
    its mean z term (None when the z-loss is off), its unmasked labels, its share of the
    step (``StageLoss.weigh``; 1 when unweighed: evaluation) and a mixture-of-experts model's
    statistics (None when dense)."""

    ce: torch.Tensor
    z: torch.Tensor | None
    labels: torch.Tensor
    share: torch.Tensor
    moe: torch.Tensor | None = None
    # a mixture's rows: (source index, loss sum, labels) of each row; None when untracked
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the multi-token depths' summed losses × each depth's label weight; None without
    depths: torch.Tensor | None = None


def head_terms(
    out: Any, labels: torch.Tensor, loss: LossSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(objective, mean cross-entropy, mean z, per-token cross-entropy)`` of one
    micro-batch, as ``micro_batch_loss`` computes them: from the logits, or from the chunked
    loss's ``(objective, per-token loss, z)`` (the stage computed it, z term included). Means
    over the unmasked labels; the per-token loss detached (0 where a label is masked)."""
    counted = labels != IGNORE_INDEX
    n = counted.sum().clamp(min=1)  # a fully masked micro-batch adds nothing (its share is 0)
    if isinstance(out, tuple):
        objective, per_token, z = out
    else:
        logits = out.float()
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        objective, z = per_token.sum() / n, None
        if loss.z_weight > 0:
            z = (logits.logsumexp(-1).square() * counted).sum() / n
            objective = objective + loss.z_weight * z
    z_logged = z.detach() if z is not None and loss.z_weight > 0 else None
    per_token = per_token.detach()
    return objective, per_token.sum() / n, z_logged, per_token


class StageLoss:
    """The schedule's ``loss_fn``: a micro-batch's objective (``head_terms`` plus a
    mixture-of-experts model's ``moe_terms``) times its share of the step, its labels times
    ``label_weight`` (``weigh``: token slices over the step's labels on all of them), so the sum
    over micro-batches (the schedules run with ``scale_grads=False``) is the gradient of the
    token-weighted mean, as ``text_step`` takes it.

    The schedule keeps only the objective; each micro-batch's ``MicroRecord`` is kept here
    for the step to ``take``. The share comes from the micro-batch's own labels, so it does
    not matter in which order a schedule computes the losses.
    """

    def __init__(self, loss: LossSpec = PLAIN_LOSS, moe: bool = False, depth: int = 0) -> None:
        self.loss = loss
        self.moe = moe
        self.depth = depth  # the model's multi-token depths
        self._per_label: torch.Tensor | None = None
        self._per_target: torch.Tensor | None = None
        self._records: list[MicroRecord] = []
        self.sources = False  # whether targets carry each row's source (``track``)

    def weigh(self, per_label: torch.Tensor | None, per_target: torch.Tensor | None = None) -> None:
        """Set one label's weight for the coming step (None: every micro-batch weighs 1) and
        one target's of each multi-token depth ``(depth,)`` (None: the step computes no
        depth: evaluation)."""
        self._per_label = per_label
        self._per_target = per_target

    def track(self, sources: bool) -> None:
        """Record each row's source, loss sum and labels in the coming run (``rows``); its
        targets then carry each row's source index as a last column (``with_sources``),
        which the schedule splits with the labels."""
        self.sources = sources

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        out, stats = split_moe_output(output, self.moe)
        out, depths = split_mtp_output(out, self._per_target is not None)
        labels, rows = (target[:, :-1], target[:, -1]) if self.sources else (target, None)
        objective, ce, z, per_token = head_terms(out, labels, self.loss)
        row_sums = None
        if rows is not None:
            row_sums = (rows, per_token.sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1))
        if stats is not None:
            objective = (
                objective
                + moe_terms(stats, self.loss.moe_aux_weight, self.loss.moe_z_weight).objective
            )
            stats = stats.detach()
        count = (labels != IGNORE_INDEX).sum()
        if self._per_label is None:
            share = torch.ones((), device=objective.device)
        else:
            share = count * self._per_label.to(objective.device)
        objective = objective * share
        if depths is not None and self._per_target is not None:
            weighed = depths * self._per_target.to(depths.device)
            objective = objective + self.loss.mtp_weight / self.depth * weighed.sum()
            depths = weighed.detach()
        record = MicroRecord(ce, z, count, share.detach(), stats, row_sums, depths)
        self._records.append(record)
        return objective

    def take(self, n: int) -> list[MicroRecord]:
        """The last ``n`` micro-batches' records, forgetting all.

        Only the last ``n``: a schedule's first step (and the first after a switch between
        evaluation and training) also calls the loss on placeholder tensors to infer the
        backward's shapes, and those calls' values are garbage.
        """
        records, self._records = self._records[-n:] if n > 0 else [], []
        return records


def stage_sums(
    records: list[MicroRecord], device: torch.device, with_z: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's token-weighted loss and, ``with_z``, z term from the last stage's
    ``records`` (``Σ value × share``), zeros on a rank without the last stage: every rank
    then adds the same tensors over the pipeline group."""
    loss = torch.zeros((), device=device)
    z = torch.zeros((), device=device) if with_z else None
    for r in records:
        loss = loss + r.ce.float() * r.share
        if z is not None and r.z is not None:
            z = z + r.z.float() * r.share
    return loss, z


def with_sources(labels: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """The last stage's target when a mixture's sources are tracked: ``labels`` ``(B, T)``
    with each row's source index as column ``T`` (``StageLoss`` splits them again)."""
    return torch.cat([labels, sources.to(labels.dtype)[:, None]], dim=1)


def source_sums(records: list[MicroRecord], stats: SourceStats) -> torch.Tensor:
    """A mixture's per-source sums ``(2, sources)`` of the step's ``records`` (``rows``)."""
    for r in records:
        if r.rows is not None:
            stats.add(*r.rows)
    return stats.drain()
