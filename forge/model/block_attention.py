"""Attention in key blocks merged by their log-sum-exp: a context-parallel rank's queries over
the whole sequence's keys without a ``T_local × T`` mask (``forge.model.context_attention``).

A rank holds two chunks of queries (``forge.data.context_split``'s head and tail). Chunk
``i`` sees the keys of chunks ``0..i``: one block of earlier keys that every query of the
chunk sees whole (plain causal rows: no mask at all) and the chunk's own keys under the
causal diagonal. Each block is one call of the fused CPU SDPA kernel, which returns the
block's output and log-sum-exp without materialising the scores; the blocks merge exactly
(softmax over a union of keys). The backward runs the kernel's backward per block with the
merged output and log-sum-exp, which gives each block its exact share of the gradients — the
ring-attention recipe, without the ring: keys and values arrive all-gathered. Masks (packed
documents, a window) exist only per block, as booleans, and are made additive per call.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from forge.data.context_split import head_tail_indices


@attrs.frozen
class KeyBlock:
    """One kernel call: local query rows ``rows`` against the keys ``keys`` (sequence order)
    under the causal diagonal (``causal``: the block is square on the diagonal) or under
    ``keep`` (boolean ``(B or 1, 1, rows, keys)``), or seeing every key (neither)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool = False
    keep: torch.Tensor | None = attrs.field(default=None, eq=False)


def query_chunks(seq_len: int, cp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """``(first local row, first global index)`` of each chunk of ``rank``'s queries."""
    indices = head_tail_indices(seq_len, cp, rank)
    chunk = seq_len // (2 * cp)
    return tuple((row, int(indices[row])) for row in (0, chunk))


def key_blocks(
    seq_len: int,
    cp: int,
    rank: int,
    window: int,
    documents: tuple[torch.Tensor, torch.Tensor] | None = None,
    device: torch.device | None = None,
) -> tuple[KeyBlock, ...]:
    """The blocks of ``rank``'s queries over the ``seq_len`` keys: causal, within the last
    ``window`` keys (0: no window), and for packed rows in the query's own document
    (``documents``: this rank's ``(B, T_local)`` ids and the whole ``(B, T)`` row's), their
    masks on ``device``. Each chunk's diagonal block comes first, so a merge starts from a
    block every query sees."""
    chunk = seq_len // (2 * cp)
    window = 0 if window >= seq_len else window  # a window over the whole row is none
    blocks: list[KeyBlock] = []
    for row, start in query_chunks(seq_len, cp, rank):
        rows = (row, row + chunk)
        # the earliest key the chunk's first query may see under the window
        first = max(0, start - window + 1) if window else 0
        for keys in ((start, start + chunk), (first, start)):
            if keys[0] == keys[1]:
                continue
            diagonal = keys[0] == start
            if not window and documents is None:
                blocks.append(KeyBlock(rows, keys, causal=diagonal))
                continue
            query = torch.arange(start, start + chunk, device=device)[:, None]
            key = torch.arange(*keys, device=device)[None, :]
            keep = key <= query
            if window:
                keep = keep & (query - key < window)
            keep = keep[None, None]
            if documents is not None:
                mine, every = documents
                same = mine[:, row : row + chunk, None] == every[:, None, keys[0] : keys[1]]
                keep = keep & same[:, None]
            blocks.append(KeyBlock(rows, keys, keep=keep))
    return tuple(blocks)


def additive(keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``keep`` as the kernel's mask: 0 where a key is seen, -inf where not (its dtype must
    be the query's)."""
    if keep is None:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
        ~keep, float("-inf")
    )


def _span(x: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return x[:, :, span[0] : span[1]]


class BlockAttention(torch.autograd.Function):
    """``q`` ``(B, H, T_local, D)`` over ``k``, ``v`` ``(B, H_kv, T, D)`` (sequence order)
    block by block; grouped-query heads are the kernel's own."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: tuple[KeyBlock, ...]
    ) -> torch.Tensor:
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        merged: set[tuple[int, int]] = set()
        for block in blocks:
            o, block_lse = kernel(
                _span(q, block.rows), _span(k, block.keys), _span(v, block.keys), 0.0,
                block.causal, attn_mask=additive(block.keep, q.dtype),
            )  # fmt: skip
            if block.keep is not None:  # the kernel gives a row that sees nothing lse 0
                seen = block.keep.any(-1)
                block_lse = block_lse.masked_fill(~seen, float("-inf"))
            o_acc, lse_acc = _span(out, block.rows), lse[:, :, block.rows[0] : block.rows[1]]
            if block.rows not in merged:  # the diagonal: every query sees its own key
                merged.add(block.rows)
                o_acc.copy_(o)
                lse_acc.copy_(block_lse)
                continue
            # the kernel rounds a bf16 block's output before this fp32 merge: a second
            # rounding, within bf16's own error
            total = torch.logaddexp(lse_acc, block_lse)
            o_acc.mul_(torch.exp(lse_acc - total)[..., None])
            o_acc.add_(o.float() * torch.exp(block_lse - total)[..., None])
            lse_acc.copy_(total)
        result = out.to(q.dtype)
        ctx.blocks = blocks
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for block in ctx.blocks:
            rows, keys = block.rows, block.keys
            gq, gk, gv = kernel(
                _span(grad, rows).contiguous(), _span(q, rows), _span(k, keys), _span(v, keys),
                _span(out, rows), lse[:, :, rows[0] : rows[1]], 0.0, block.causal,
                attn_mask=additive(block.keep, q.dtype),
            )  # fmt: skip
            _span(dq, rows).add_(gq)
            _span(dk, keys).add_(gk)
            _span(dv, keys).add_(gv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: tuple[KeyBlock, ...]
) -> torch.Tensor:
    """``BlockAttention`` of ``q`` over ``k``, ``v`` in ``blocks`` (``key_blocks``)."""
    return BlockAttention.apply(q, k, v, blocks)  # type: ignore[no-any-return]


def is_plain(blocks: tuple[KeyBlock, ...]) -> bool:
    """Whether no block has a mask: causal rows, no documents, no window."""
    return all(block.keep is None for block in blocks)


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: tuple[KeyBlock, ...], gqa: bool
) -> torch.Tensor:
    """For devices without the CPU kernel, plain rows (``is_plain``): each query chunk over
    the keys up to its own end, one SDPA call under a causal mask aligned to the last key
    (``causal_lower_right``), which CUDA's fused kernels apply without materialising it."""
    # imported here: torch.nn.attention.bias imports torch's compiler (about 1.7 s of every
    # process's start-up), and only a GPU's context-parallel rows use it
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for block in blocks:
        if not block.causal:
            continue
        rows, end = block.rows, block.keys[1]
        causal = causal_lower_right(rows[1] - rows[0], end)
        query, key, value = _span(q, rows), k[:, :, :end], v[:, :, :end]
        outs.append(
            F.scaled_dot_product_attention(query, key, value, attn_mask=causal, enable_gqa=gqa)
        )
    return torch.cat(outs, dim=2)


def dense_keep(
    blocks: tuple[KeyBlock, ...], t_local: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """The blocks as one boolean ``(B or 1, 1, T_local, T)`` mask, for devices without the
    CPU kernel when rows are packed or windowed (plain SDPA with a mask)."""
    batch = max((b.keep.shape[0] for b in blocks if b.keep is not None), default=1)
    keep = torch.zeros(batch, 1, t_local, seq_len, dtype=torch.bool, device=device)
    for block in blocks:
        (r0, r1), (k0, k1) = block.rows, block.keys
        if block.keep is not None:
            keep[:, :, r0:r1, k0:k1] = block.keep.to(device)
        elif block.causal:
            keep[:, :, r0:r1, k0:k1] = torch.ones(r1 - r0, k1 - k0, device=device).tril().bool()
        else:
            keep[:, :, r0:r1, k0:k1] = True
    return keep
