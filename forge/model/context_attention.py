"""Context-parallel attention, all-gather form (``distributed.cp``; Llama 3's long-context
choice): each rank keeps the queries of its own tokens (``forge.data.context_split``'s
head–tail chunks) and attends to the keys and values of the whole sequence, all-gathered
over the context-parallel group.

The gather's backward is a reduce-scatter (``_functional_collectives.all_gather_single``,
autograd-aware; ``torch.distributed.nn.functional.all_gather`` is not used: on gloo its
backward scatters from group ranks as if they were global ones, wrong in a subgroup), so each
rank receives the key and value gradients of its own tokens from every query that saw them.
Keys and values go in one gather per layer: two gathers of the same shape, whose backward
order the ranks need not agree on, would swap their gradients. The gathered keys stay in the
gather's order (attention is invariant to the order of its keys): the mask compares global
token indices instead (causal: key index ≤ query index; a window; for packed rows equal
document ids, whose gather needs no gradient). Grouped-query attention gathers the KV heads
before SDPA repeats them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import attrs
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from forge.data.context_split import gathered_indices, head_tail_indices


@attrs.frozen
class ContextMask:
    """What every layer of a context-parallel forward shares: the group to gather keys and
    values over and the boolean mask ``(B or 1, 1, T_local, T)`` of this rank's queries over
    the gathered keys (in the gather's order).

    SDPA on a CPU turns a boolean mask into an additive one of the compute dtype at every
    call and keeps that copy for the backward: one ``T_local × T`` float tensor per layer.
    ``bias`` makes it once per forward and dtype, for every layer to share."""

    group: ProcessGroup
    mask: torch.Tensor
    biases: dict[torch.dtype, torch.Tensor] = attrs.field(factory=dict, eq=False, repr=False)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask in ``dtype``: 0 where a key is seen, -inf where not."""
        if dtype not in self.biases:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self.biases[dtype] = zeros.masked_fill_(~self.mask, float("-inf"))
        return self.biases[dtype]


def gather_sequence(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, differentiable (the
    backward reduce-scatters: each rank gets the sum of its part's gradients)."""
    gathered = funcol.all_gather_single_autograd(x.contiguous()[None], 0, group)
    parts = gathered.unbind(0)  # (cp, *x.shape) -> cp tensors of x's shape
    return torch.cat(parts, dim=dim)


def gather_plain(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """``gather_sequence`` without a gradient (document ids)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def context_keep(
    seq_len: int, cp: int, rank: int, window: int, device: torch.device
) -> torch.Tensor:
    """Boolean ``(T_local, T)``: which gathered keys each of ``rank``'s queries may see by
    position (causal, and within the last ``window`` keys; 0: no window)."""
    query = head_tail_indices(seq_len, cp, rank).to(device)[:, None]
    key = gathered_indices(seq_len, cp).to(device)[None, :]
    keep = key <= query
    if window:
        keep = keep & (query - key < window)
    return keep


def context_mask(
    group: ProcessGroup,
    document_ids: torch.Tensor | None,
    t_local: int,
    window: int,
    device: torch.device,
) -> ContextMask:
    """The ``ContextMask`` of a forward over this rank's ``t_local`` tokens of every row
    (``document_ids`` ``(B, t_local)`` for packed rows, else None)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    keep = context_keep(t_local * cp, cp, rank, window, device)
    if document_ids is None:
        return ContextMask(group, keep[None, None])
    every = gather_plain(document_ids, group, dim=1)
    same = document_ids[:, :, None] == every[:, None, :]
    return ContextMask(group, (same & keep)[:, None])


def context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ContextMask, gqa: bool
) -> torch.Tensor:
    """This rank's queries ``(B, H, T_local, D)`` over every rank's keys and values
    (``(B, H_kv, T_local, D)`` each, gathered along the sequence); returns ``(B, H,
    T_local, D)``."""
    # one collective for both (its backward too): never two of the same shape whose order
    # ranks could disagree on
    k_all, v_all = gather_sequence(torch.stack([k, v]), mask.group, dim=3).unbind(0)
    bias = mask.bias(q.dtype)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=bias, enable_gqa=gqa)


@functools.cache
def uncompiled_context_attention() -> Callable[..., torch.Tensor]:
    """``context_attention`` kept out of ``torch.compile`` (collectives on a process group)."""
    return cast(Callable[..., torch.Tensor], torch.compiler.disable(context_attention))
