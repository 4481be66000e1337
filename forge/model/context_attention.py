"""Context-parallel attention, all-gather form (``distributed.cp``; Llama 3's long-context
choice): each rank keeps the queries of its own tokens (``forge.data.context_split``'s
head–tail chunks) and attends to the keys and values of the whole sequence, all-gathered
over the context-parallel group.

The gather's backward is a reduce-scatter (``_functional_collectives.all_gather_single``,
autograd-aware; ``torch.distributed.nn.functional.all_gather`` is not used: on gloo its
backward scatters from group ranks as if they were global ones, wrong in a subgroup), so each
rank receives the key and value gradients of its own tokens from every query that saw them.
Keys and values go in one gather per layer: two gathers of the same shape, whose backward
order the ranks need not agree on, would swap their gradients. The gathered chunks are put
back in sequence order, and a rank's queries attend block by block
(``forge.model.block_attention``): on a CPU no ``T_local × T`` mask or score matrix exists,
so a rank's activation memory falls with ``cp`` but for the gathered keys and values.
Elsewhere (CUDA) plain rows attend chunk by chunk under SDPA's lower-right causal mask,
which the fused kernels apply without materialising it; packed or windowed rows make one
boolean mask of the blocks for SDPA.
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

from forge.model.block_attention import (
    KeyBlock,
    block_attention,
    chunk_attention,
    dense_keep,
    is_plain,
    key_blocks,
)


@attrs.frozen
class ContextMask:
    """What every layer of a context-parallel forward shares: the group to gather keys and
    values over and the key blocks of this rank's queries (``key_blocks``), built once per
    forward, outside the compiled blocks; ``attend`` is ``context_attention`` kept out of
    ``torch.compile``, looked up there so that a compiled block calls it without tracing
    the cached lookup."""

    group: ProcessGroup
    blocks: tuple[KeyBlock, ...]
    # off the CPU, packed or windowed rows: the blocks as one boolean mask, made once here
    # rather than in every layer (SDPA still makes each layer an additive copy of it)
    dense: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    attend: Callable[..., torch.Tensor] = attrs.field(
        factory=lambda: uncompiled_context_attention(), eq=False, repr=False
    )


def in_sequence_order(gathered: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's head–tail chunks ``gathered`` ``(cp, ...)`` (rank order) as one tensor in
    sequence order along ``dim`` of a part: rank ``r``'s head is chunk ``r``, its tail chunk
    ``2·cp − 1 − r``."""
    parts = gathered.unbind(0)
    heads = [part.narrow(dim, 0, part.shape[dim] // 2) for part in parts]
    tails = [part.narrow(dim, part.shape[dim] // 2, part.shape[dim] // 2) for part in parts]
    return torch.cat([*heads, *reversed(tails)], dim=dim)


def gather_sequence(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's ``x`` in sequence order along ``dim``, differentiable (the backward
    reduce-scatters: each rank gets the sum of its tokens' gradients)."""
    gathered = funcol.all_gather_single_autograd(x.contiguous()[None], 0, group)
    return in_sequence_order(gathered, dim)


def gather_plain(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """``gather_sequence`` without a gradient (document ids)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return in_sequence_order(torch.stack(parts), dim)


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
    seq_len = t_local * cp
    documents = None
    if document_ids is not None:
        documents = (document_ids, gather_plain(document_ids, group, dim=1))
    blocks = key_blocks(seq_len, cp, rank, window, documents, device)
    dense = None
    if not uses_blocks(device) and not is_plain(blocks):
        dense = dense_keep(blocks, t_local, seq_len, device)
    return ContextMask(group, blocks, dense)


def uses_blocks(device: torch.device) -> bool:
    """Whether attention runs block by block (the fused kernel with a log-sum-exp exists
    for the CPU) rather than as SDPA under one dense mask."""
    return device.type == "cpu"


def attend_gathered(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: tuple[KeyBlock, ...],
    gqa: bool,
    dense: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's queries ``(B, H, T_local, D)`` over the whole sequence's keys and values
    ``(B, H_kv, T, D)`` (sequence order) in ``blocks``: block by block on a CPU; elsewhere
    chunk by chunk for plain rows, under the blocks' one dense mask (``dense`` when already
    made) for packed or windowed ones."""
    if uses_blocks(q.device):
        return block_attention(q, k, v, blocks)
    if is_plain(blocks):
        return chunk_attention(q, k, v, blocks, gqa)
    keep = dense if dense is not None else dense_keep(blocks, q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=gqa)


def context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ContextMask, gqa: bool
) -> torch.Tensor:
    """This rank's queries ``(B, H, T_local, D)`` over every rank's keys and values
    (``(B, H_kv, T_local, D)`` each, gathered along the sequence); returns ``(B, H,
    T_local, D)``."""
    # one collective for both (its backward too): never two of the same shape whose order
    # ranks could disagree on
    k_all, v_all = gather_sequence(torch.stack([k, v]), mask.group, dim=3).unbind(0)
    return attend_gathered(q, k_all, v_all, mask.blocks, gqa, mask.dense)


@functools.cache
def uncompiled_context_attention() -> Callable[..., torch.Tensor]:
    """``context_attention`` kept out of ``torch.compile`` (collectives on a process group)."""
    return cast(Callable[..., torch.Tensor], torch.compiler.disable(context_attention))
