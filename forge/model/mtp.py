"""Multi-token prediction (DeepSeek-V3's form): ``model.mtp_depth`` modules after the main
model, module k predicting the token k + 1 places past each position.

Module k takes the previous depth's hidden state at position i (the main model's final hidden
state for k = 1) and the embedding of token i + k, normalises each (RMSNorm), projects their
concatenation back to the model width, runs one transformer block over it (block
``n_layers + k - 1``: a dense SwiGLU, or with ``model.mtp_moe`` a mixture of experts like the
model's, its statistics beside the main blocks') and, through its own final norm, the main
model's output head (shared, as the embedding is) predicts token i + k + 1.
Parameter names: ``mtp.<k>.{hidden_norm, embed_norm, proj, block, norm}``.

Every depth keeps the main sequence length: position i of depth k is a target only when the
tokens i + 1 … i + k + 1 are all labels of the row (``depth_targets``), so no depth predicts
past the row's end or across a packed document's boundary (the main labels are masked
there). A depth's loss is returned as the *sum* of its cross-entropy over its targets; the
step weighs each depth's labels alike across micro-batches and ranks (``depth_counts``), as
it weighs the main loss's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from forge.config.model import ModelConfig
from forge.data.context_split import head_tail_indices
from forge.data.packing import IGNORE_INDEX
from forge.model.attention import AttentionMask
from forge.model.chunked_loss import LossSpec, chunked_lm_loss


def depth_targets(
    inputs: torch.Tensor, labels: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tokens depth ``depth`` embeds, its targets), both ``(B, T)``: token i + k and
    token i + k + 1 for each position i, the target ignored unless the main labels of
    positions i … i + k are all labels (the row's end and document boundaries)."""
    k, t = depth, inputs.shape[1]
    if k >= t:
        return torch.zeros_like(inputs), torch.full_like(labels, IGNORE_INDEX)
    tokens = F.pad(inputs[:, k:], (0, k))
    targets = F.pad(labels[:, k:], (0, k), value=IGNORE_INDEX)
    labelled = labels != IGNORE_INDEX
    chain = labelled.clone()
    for j in range(1, k + 1):  # positions i … i + k all labelled
        chain[:, : t - j] &= labelled[:, j:]
        chain[:, t - j :] = False
    return tokens, targets.masked_fill(~chain, IGNORE_INDEX)


def whole_rows(part: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The whole rows ``(B, T)`` of which this context-parallel rank of ``group`` holds its
    head–tail part ``part`` (``forge.data.context_split``): one all-gather of token ids."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(part) for _ in range(cp)]
    dist.all_gather(parts, part.contiguous(), group=group)
    t = part.shape[1] * cp
    rows = part.new_empty(part.shape[0], t)
    for rank, piece in enumerate(parts):
        rows[:, head_tail_indices(t, cp, rank).to(part.device)] = piece
    return rows


def depth_inputs(
    inputs: torch.Tensor, labels: torch.Tensor, depth: int, group: ProcessGroup | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``depth_targets`` of each depth 1 … ``depth`` at this rank's positions. Under context
    parallelism (``group``) a rank holds parts of each row, and a depth's token and target at
    its last positions lie in a peer's part: they are taken from the whole rows and cut back
    to this rank's positions."""
    if group is None:
        return [depth_targets(inputs, labels, k) for k in range(1, depth + 1)]
    rows, row_labels = whole_rows(inputs, group), whole_rows(labels, group)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = head_tail_indices(rows.shape[1], cp, rank).to(rows.device)
    cut = [depth_targets(rows, row_labels, k) for k in range(1, depth + 1)]
    return [
        (tokens.index_select(1, mine), targets.index_select(1, mine)) for tokens, targets in cut
    ]


def depth_counts(
    labels: torch.Tensor, depth: int, group: ProcessGroup | None = None
) -> torch.Tensor:
    """The targets of each depth 1 … ``depth`` at this rank's positions of ``labels``, as
    floats ``(depth,)`` (``group``: the context-parallel group, ``depth_inputs``)."""
    cut = depth_inputs(torch.zeros_like(labels), labels, depth, group)
    return torch.stack([(targets != IGNORE_INDEX).sum() for _, targets in cut]).float()


class MTPModule(nn.Module):
    """One depth: the two norms, the projection, a transformer block and the final norm before
    the shared head. The decoder builds it with its own norm and block classes (``norm``,
    ``block``)."""

    def __init__(self, cfg: ModelConfig, norm: Callable[[], nn.Module], block: nn.Module) -> None:
        super().__init__()
        self.hidden_norm = norm()
        self.embed_norm = norm()
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = norm()

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None = None,
        moe_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This depth's hidden state (the next depth's input), its final norm of it (the
        head's input) and the MoE statistics (``moe_stats`` with this block's, when it is a
        mixture of experts), in one forward (so that FSDP2 gathers the depth's weights once);
        with ``cache`` (its block's keys and values and how many positions they hold:
        generation), the new positions'."""
        joined = torch.cat([self.hidden_norm(hidden), self.embed_norm(embedded)], dim=-1)
        out = self.block(self.proj(joined), cos, sin, mask, cache, moe_stats)
        if isinstance(out, tuple):
            out, moe_stats = out
        return out, self.norm(out), moe_stats


def depth_loss_sum(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, loss: LossSpec | None
) -> torch.Tensor:
    """The summed cross-entropy of the logits ``head(hidden)`` over ``targets``: through the
    chunked loss when ``loss`` is chunked (no full logits, no z term), else the plain one on
    fp32 logits (through the head module, so that a tensor-parallel plan's hooks gather
    them)."""
    if loss is not None and loss.chunked:
        spec = attrs.evolve(loss, z_weight=0.0)
        weight = head.weight
        assert isinstance(weight, torch.Tensor)
        objective, _, _ = chunked_lm_loss(hidden, weight, targets, spec)
        return objective * (targets != IGNORE_INDEX).sum().clamp(min=1)
    logits = head(hidden).float()
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum")


def depth_losses(
    model: nn.Module,
    h: torch.Tensor,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: AttentionMask,
    loss: LossSpec | None,
    moe_stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each depth's summed cross-entropy ``(mtp_depth,)`` from the main model's last hidden
    state ``h``, through ``model``'s depths, embedding and output head, and ``moe_stats`` with
    the depths' mixture-of-experts blocks' (``model.mtp_moe``)."""
    depths, embedding, head = model.mtp, model.tok_embeddings, model.output
    assert isinstance(depths, nn.ModuleDict)
    assert isinstance(embedding, nn.Module) and isinstance(head, nn.Module)
    cut = depth_inputs(tokens, labels, len(depths), getattr(model, "context_group", None))
    sums = []
    for (embedded_tokens, targets), module in zip(cut, depths.values(), strict=True):
        h, normed, moe_stats = module(h, embedding(embedded_tokens), *rope, mask, None, moe_stats)
        sums.append(depth_loss_sum(normed, head, targets, loss))
    return torch.stack(sums), moe_stats


def split_mtp_output(output: Any, mtp: bool) -> tuple[Any, torch.Tensor | None]:
    """``(output, depth sums)`` of the forward of a model with multi-token depths given
    labels (``mtp``), or ``(output, None)``."""
    if not mtp:
        return output, None
    rest = tuple(output[:-1])
    return (rest[0] if len(rest) == 1 else rest), output[-1]


def has_mtp(model: nn.Module) -> bool:
    """Whether ``model`` (possibly FSDP-wrapped) has multi-token depths."""
    return isinstance(getattr(model, "mtp", None), nn.ModuleDict)
