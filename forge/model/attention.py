"""Self-attention kernels and which one runs (``model.attention``, ``model.sliding_window``).

Every backend computes the same function: causal attention, kept within each document of a
packed row (``document_ids``), and within the last ``sliding_window`` keys when one is set.

- ``CAUSAL``: SDPA ``is_causal`` (rows that are one sequence each);
- ``SEGMENTS``: SDPA ``is_causal`` per document segment, never a T×T mask. Segments of one
  padded length share one call (short ones right-padded: under a causal mask no real query
  sees a padded key, and the padded queries' outputs are dropped, so the result is exact);
- ``DENSE_MASK``: SDPA with a boolean ``(B, 1, T, T)`` mask (packed rows on a GPU under
  ``sdpa``, and every sliding window outside flex and varlen);
- ``FLEX``: FlexAttention with a block mask built once per forward (compiled on CUDA; a CPU
  runs its forward only: torch 2.13 has no CPU backward for it);
- ``VARLEN``: torch's ``varlen_attn`` (flash attention) over cumulative segment lengths: CUDA
  and bf16/fp16 only.

The mask object (a tensor, ``DocumentSegments``, a ``BlockMask``, ``VarlenSpans`` or None) is
built once in ``Transformer.forward`` and passed to every block in the place of the mask
tensor, so the tensor-parallel plan's four block inputs stay as they are.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import attrs
import torch
import torch.nn.functional as F

from forge.config.model import AttentionBackend, ModelConfig
from forge.errors import UserInputError
from forge.model.context_attention import ContextMask

if TYPE_CHECKING:  # flex_attention imports torch's compiler: only where a forward uses it
    from torch.nn.attention.flex_attention import BlockMask


class Backend(enum.Enum):
    """The kernel one forward runs (``choose_backend``)."""

    CAUSAL = "sdpa causal"
    SEGMENTS = "sdpa per document"
    DENSE_MASK = "sdpa dense mask"
    FLEX = "flex"
    VARLEN = "varlen"


def choose_backend(
    device_type: str, packed: bool, configured: AttentionBackend, window: int = 0
) -> Backend:
    """The backend for rows on ``device_type``, ``packed`` (several documents per row) or
    not, under ``model.attention`` = ``configured`` and a ``window`` (0: none). Pure."""
    if configured is AttentionBackend.FLEX:
        return Backend.FLEX
    if configured is AttentionBackend.VARLEN:
        return Backend.VARLEN
    if configured is AttentionBackend.AUTO and device_type == "cuda" and (packed or window):
        return Backend.FLEX  # no T×T mask, no host read, fp32 too (varlen is bf16/fp16 only)
    if window:
        return Backend.DENSE_MASK  # SDPA has no window of its own
    if not packed:
        return Backend.CAUSAL
    # per document needs the boundaries on the host: free on a CPU, a device sync elsewhere
    return Backend.SEGMENTS if device_type == "cpu" else Backend.DENSE_MASK


FLEX_ON_CPU = (
    "model.attention='flex' cannot train on a CPU: FlexAttention has no CPU backward in "
    "torch 2.13 (its forward runs: evaluation, generation); set model.attention='auto'"
)
VARLEN_OFF_CUDA = (
    "model.attention='varlen' needs a CUDA device: torch's varlen_attn is flash attention, "
    "with no CPU kernel; set model.attention='auto'"
)
VARLEN_FP32 = (
    "model.attention='varlen' needs train.mixed_precision='bf16': flash attention has no "
    "fp32 kernel; set model.attention='auto' (flex on CUDA) or train in bf16"
)


def attention_problem(
    cfg: ModelConfig, device_type: str, bf16: bool, training: bool = True
) -> str | None:
    """Why ``model.attention`` cannot run on ``device_type`` (in bf16 compute or not), for
    validation before anything is built; None when it can."""
    if cfg.attention is AttentionBackend.VARLEN:
        if device_type != "cuda":
            return VARLEN_OFF_CUDA
        return None if bf16 else VARLEN_FP32
    if cfg.attention is AttentionBackend.FLEX and device_type == "cpu" and training:
        return FLEX_ON_CPU
    return None


def runnable_here(cfg: ModelConfig, device_type: str, bf16: bool) -> ModelConfig:
    """``cfg`` for evaluation or generation on ``device_type``: its own ``model.attention``
    where that runs there, else ``auto`` (every backend computes the same function, so a run
    trained with ``varlen`` on GPUs evaluates on a CPU)."""
    if attention_problem(cfg, device_type, bf16, training=False) is None:
        return cfg
    return attrs.evolve(cfg, attention=AttentionBackend.AUTO)


@attrs.frozen
class SegmentGroup:
    """Segments computed by one SDPA call at one padded length ``P``: ``index`` ``(n, P)``
    holds each slot's flat token index (``row * T + position``; a padding slot repeats its
    segment's last token), ``keep`` the flat slots of real tokens (None: no padding)."""

    index: torch.Tensor
    keep: torch.Tensor | None


@attrs.frozen
class DocumentSegments:
    """A packed batch's documents as groups of segments; ``inverse`` puts each token's
    output back: the groups' real outputs, concatenated, taken at ``inverse``."""

    groups: tuple[SegmentGroup, ...]
    inverse: torch.Tensor


# below this length a segment is right-padded to a power of two, so that the many short
# documents of a row share a few calls; from it on a call's compute outweighs its overhead
SHORT_SEGMENT = 64


def padded_length(n: int) -> int:
    """The length a segment of ``n`` tokens is computed at."""
    return n if n >= SHORT_SEGMENT else 1 << (n - 1).bit_length()


def segment_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: where a segment starts (every row's first token, every id change)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_segments(document_ids: torch.Tensor) -> DocumentSegments | None:
    """The segments of ``(B, T)`` document ids, grouped by padded length; None when every
    row is one document (plain causal attention). Reads the boundaries on the host once: a
    CPU tensor's, so no device sync; every layer of the forward shares the result."""
    b, t = document_ids.shape
    device = document_ids.device
    first = segment_starts(document_ids).flatten().nonzero().flatten()
    bounds: list[int] = [*first.tolist(), b * t]
    if len(bounds) == b + 1:  # one segment per row: each row is one document
        return None
    by_length: dict[int, tuple[list[int], list[int]]] = {}
    for start, end in itertools.pairwise(bounds):
        starts, lengths = by_length.setdefault(padded_length(end - start), ([], []))
        starts.append(start)
        lengths.append(end - start)
    groups, order = [], []
    for p, (starts, lengths) in sorted(by_length.items()):
        s = torch.tensor(starts, device=device)[:, None]
        n = torch.tensor(lengths, device=device)[:, None]
        slot = torch.arange(p, device=device)[None, :]
        real = slot < n
        groups.append(
            SegmentGroup(
                index=s + torch.minimum(slot, n - 1),
                keep=None if min(lengths) == p else real.flatten().nonzero().flatten(),
            )
        )
        order.append((s + slot)[real])
    inverse = torch.empty(b * t, dtype=torch.long, device=device)
    inverse[torch.cat(order)] = torch.arange(b * t, device=device)
    return DocumentSegments(tuple(groups), inverse)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: DocumentSegments, gqa: bool
) -> torch.Tensor:
    """SDPA ``is_causal`` per document segment of ``q`` ``(B, H, T, D)`` and ``k``, ``v``
    ``(B, H_kv, T, D)`` (the values may be narrower: latent attention's), all heads at once;
    returns ``(B, H, T, D_v)``."""
    b, h, t, _ = q.shape
    d = v.shape[-1]

    def flat(x: torch.Tensor) -> torch.Tensor:  # (B*T, heads, D): one row per token
        return x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[-1])

    qf, kf, vf = flat(q), flat(k), flat(v)
    outs = []
    for group in segments.groups:
        n, p = group.index.shape
        idx = group.index.flatten()

        def gather(
            x: torch.Tensor, n: int = n, p: int = p, idx: torch.Tensor = idx
        ) -> torch.Tensor:
            return x.index_select(0, idx).view(n, p, x.shape[1], x.shape[-1]).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            gather(qf), gather(kf), gather(vf), is_causal=True, enable_gqa=gqa
        )
        o = o.transpose(1, 2).reshape(n * p, h, d)
        outs.append(o if group.keep is None else o.index_select(0, group.keep))
    out = torch.cat(outs).index_select(0, segments.inverse)
    return out.view(b, t, h, d).transpose(1, 2)


@functools.cache
def uncompiled_segment_attention() -> Callable[..., torch.Tensor]:
    """``segment_attention`` kept out of ``torch.compile``: a Python loop over this batch's
    layout, which traced would recompile for every batch. Built at first use: wrapping it
    imports torch's compiler, a second of every process's start-up."""
    return cast(Callable[..., torch.Tensor], torch.compiler.disable(segment_attention))


def dense_mask(
    document_ids: torch.Tensor | None, t: int, window: int, device: torch.device
) -> torch.Tensor:
    """Boolean ``(B or 1, 1, T, T)``: causal, within one document (with ``document_ids``)
    and within the last ``window`` keys (0: no window)."""
    query = torch.arange(t, device=device)[:, None]
    key = torch.arange(t, device=device)[None, :]
    keep = key <= query
    if window:
        keep = keep & (query - key < window)
    if document_ids is None:
        return keep[None, None]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & keep)[:, None]


def document_attention_mask(document_ids: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Boolean ``(B, 1, T, T)`` from ``(B, T)`` ids: causal and within one document."""
    return dense_mask(document_ids, document_ids.shape[-1], window, document_ids.device)


def flex_block_mask(
    document_ids: torch.Tensor | None, b: int, t: int, window: int, device: torch.device
) -> BlockMask:
    """FlexAttention's block mask of the same rule as ``dense_mask``: built once per forward,
    shared by every layer (fully masked blocks are skipped, not computed)."""

    def rule(batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        keep = q_idx >= kv_idx
        if window:
            keep = keep & (q_idx - kv_idx < window)
        if document_ids is not None:
            keep = keep & (document_ids[batch, q_idx] == document_ids[batch, kv_idx])
        return keep

    from torch.nn.attention.flex_attention import create_block_mask

    rows = b if document_ids is not None else None  # None: one mask broadcast over rows
    return create_block_mask(rule, rows, None, t, t, device=device)


@functools.cache
def compiled_flex() -> Callable[..., Any]:
    """FlexAttention through ``torch.compile``: uncompiled it materialises the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@attrs.frozen
class VarlenSpans:
    """``varlen_attn``'s cumulative segment lengths ``(N + 1,)`` int32 over the flattened
    batch, an upper bound of the longest (the row length) and the window (0: none)."""

    cu_seqlens: torch.Tensor
    max_len: int
    window: int


# what a layer receives in the place of a mask tensor (None: plain causal)
AttentionMask: TypeAlias = (
    "torch.Tensor | DocumentSegments | BlockMask | VarlenSpans | ContextMask | None"
)


def varlen_spans(
    document_ids: torch.Tensor | None, b: int, t: int, window: int, device: torch.device
) -> VarlenSpans:
    """The spans of ``b`` rows of ``t`` tokens: one per row, or one per document segment
    (their count is data-dependent: on a GPU, ``nonzero`` waits for the device once per
    forward, never per layer)."""
    if document_ids is None:
        cu = torch.arange(0, b * t + 1, t, device=device)
    else:
        first = segment_starts(document_ids).flatten().nonzero().flatten()
        cu = torch.cat([first, torch.tensor([b * t], device=device)])
    return VarlenSpans(cu.to(torch.int32), t, window)


def varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: VarlenSpans, gqa: bool
) -> torch.Tensor:
    """``varlen_attn`` over ``spans``: ``(B, H, T, D)`` in and out, like SDPA."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, t, d = q.shape

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(b * t, x.shape[1], d)

    window = (spans.window - 1, 0) if spans.window else (-1, 0)  # (-1, 0): causal
    cu = spans.cu_seqlens
    out = varlen_attn(
        flat(q), flat(k), flat(v), cu, cu, spans.max_len, spans.max_len,
        window_size=window, enable_gqa=gqa,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor)
    return out.view(b, t, h, d).transpose(1, 2)


def attention_mask(
    backend: Backend,
    document_ids: torch.Tensor | None,
    shape: tuple[int, int],
    window: int,
    device: torch.device,
) -> AttentionMask:
    """The mask object every layer of one forward shares, for rows of ``shape`` ``(B, T)``.
    Refuses, in one line naming the key, a backend this device cannot run."""
    b, t = shape
    if backend is Backend.FLEX:
        if device.type == "cpu" and torch.is_grad_enabled():
            raise UserInputError(FLEX_ON_CPU)
        return flex_block_mask(document_ids, b, t, window, device)
    if backend is Backend.VARLEN:
        if device.type != "cuda":
            raise UserInputError(VARLEN_OFF_CUDA)
        return varlen_spans(document_ids, b, t, window, device)
    if backend is Backend.SEGMENTS:
        assert document_ids is not None and not window, "per document: packed rows, no window"
        return document_segments(document_ids)
    if backend is Backend.DENSE_MASK:
        return dense_mask(document_ids, t, window, device)
    return None


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, gqa: bool
) -> torch.Tensor:
    """Attention of ``q`` ``(B, H, T, D)`` over ``k``, ``v`` ``(B, H_kv, S, D)`` under
    ``mask`` (``attention_mask``'s object, a boolean tensor, or None: causal)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if isinstance(mask, DocumentSegments):
        return uncompiled_segment_attention()(q, k, v, mask, gqa)
    if isinstance(mask, ContextMask):  # distributed.cp: keys and values over every CP rank
        return mask.attend(q, k, v, mask, gqa)
    if isinstance(mask, VarlenSpans):
        if q.dtype == torch.float32:
            raise UserInputError(VARLEN_FP32)
        return varlen(q, k, v, mask, gqa)
    from torch.nn.attention.flex_attention import flex_attention

    flex = compiled_flex() if q.device.type == "cuda" else flex_attention
    out = flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    assert isinstance(out, torch.Tensor)
    return out


def decoding_mask(start: int, t: int, window: int, device: torch.device) -> torch.Tensor:
    """The mask of ``t`` new queries at positions ``start …`` over every cached key before
    them and themselves (a KV cache's forward past its first): causal, within ``window``."""
    visible = torch.arange(start + t, device=device)[None, :]
    query = (start + torch.arange(t, device=device))[:, None]
    mask = visible <= query
    return mask & (query - visible < window) if window else mask
