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
import torch.nn.functional as F
from torch import nn

from forge.config.model import ModelConfig
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


def depth_counts(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """The targets of each depth 1 … ``depth`` in ``labels``, as floats ``(depth,)``."""
    dummy = torch.zeros_like(labels)
    return torch.stack(
        [(depth_targets(dummy, labels, k)[1] != IGNORE_INDEX).sum() for k in range(1, depth + 1)]
    ).float()


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
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, loss: LossSpec | None
) -> torch.Tensor:
    """The summed cross-entropy of the logits ``hidden @ weight.T`` over ``targets``: through
    the chunked loss when ``loss`` is chunked (no full logits, no z term), else the plain one
    on fp32 logits."""
    if loss is not None and loss.chunked:
        spec = attrs.evolve(loss, z_weight=0.0)
        objective, _, _ = chunked_lm_loss(hidden, weight, targets, spec)
        return objective * (targets != IGNORE_INDEX).sum().clamp(min=1)
    logits = F.linear(hidden, weight).float()
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
    sums = []
    for name, module in model.mtp.items():  # type: ignore[union-attr]
        embedded_tokens, targets = depth_targets(tokens, labels, int(name))
        embedded = model.tok_embeddings(embedded_tokens)  # type: ignore[operator]
        h, normed, moe_stats = module(h, embedded, *rope, mask, None, moe_stats)
        weight = model.output.weight  # type: ignore[union-attr]
        assert isinstance(weight, torch.Tensor)
        sums.append(depth_loss_sum(normed, weight, targets, loss))
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
