"""A Llama-style decoder: RoPE, grouped-query attention (SDPA), SwiGLU and RMSNorm.

Parameter names are stable (they are checkpoint keys): ``tok_embeddings``, ``layers.<i>.
attention.{wq,wk,wv,wo}``, ``layers.<i>.feed_forward.{w1,w2,w3}``, ``layers.<i>.{attention,
ffn}_norm``, ``norm``, ``output``; with ``qk_norm``, ``layers.<i>.attention.{q,k}_norm``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from forge.config.sections import ModelConfig, RopeScaling, RopeScalingType
from forge.model.attention import (
    AttentionMask,
    Backend,
    attend,
    attention_mask,
    choose_backend,
    decoding_mask,
)
from forge.model.attention import document_attention_mask as document_attention_mask
from forge.model.chunked_loss import LossSpec, chunked_lm_loss
from forge.model.context_attention import context_mask
from forge.model.feed_forward import FeedForward
from forge.model.init import fill_, initial_value
from forge.model.latent_attention import LatentAttention
from forge.model.layers import RMSNorm, apply_rope
from forge.model.moe import MoE, empty_stats
from forge.model.mtp import MTPModule, depth_losses


def llama3_frequencies(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rescaled rotary frequencies: wavelengths beyond ``original / low`` slowed by
    ``factor``, those below ``original / high`` kept, the band between interpolated. The same
    operations in the same order as transformers' ``_compute_llama3_parameters``, so that an
    imported Llama 3.x has its RoPE table bit for bit."""
    original = scaling.original_max_seq_len
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    slowed = torch.where(wavelen > original / low, freqs / scaling.factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * slowed / scaling.factor + smooth * slowed
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, slowed)


def rope_tables(
    head_dim: int, max_len: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``(max_len, head_dim // 2)``, in fp32, with the
    frequencies rescaled by ``scaling`` (``model.rope_scaling``) when given."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None and scaling.type is RopeScalingType.LLAMA3:
        freqs = llama3_frequencies(freqs, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def model_rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables of ``cfg``: its head size (latent attention: its rotated channels),
    context, base and scaling."""
    rotated = cfg.mla.rope_dim if cfg.mla is not None else cfg.head_size
    return rope_tables(rotated, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)


class KVCache:
    """Keys and values of every layer for incremental decoding: ``(B, kv_heads, max_len,
    head_dim)`` per layer, filled up to ``length`` positions. The model's forward writes the
    new positions and advances ``length``; it refuses to go past ``max_len``."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (cfg.n_layers, batch, cfg.kv_heads, cfg.max_seq_len, cfg.head_size)
        values = shape
        if cfg.mla is not None:  # latent attention keeps one latent and rotated key a token
            shape = (cfg.n_layers, batch, 1, cfg.max_seq_len, cfg.mla.cached_dim)
            values = (cfg.n_layers, batch, 1, cfg.max_seq_len, 0)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(values, dtype=dtype, device=device)
        self.max_len = cfg.max_seq_len
        self.length = 0


class Attention(nn.Module):
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_size
        self.sliding_window = cfg.sliding_window
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # one weight per head dimension, shared by every head (and so by every TP shard)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask = None,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """``mask``: what ``forge.model.attention.attention_mask`` built for this forward
        (None: causal). ``cache``: this layer's key and value buffers and how many positions
        they hold; the new keys and values are written after those and attention covers them
        all."""
        b, t, _ = x.shape
        if cos.dim() == 2:  # one table for every row: t is the full length even under SP
            cos, sin = cos[:t], sin[:t]
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv_heads != self.n_heads
        if cache is not None:
            keys, values, start = cache
            keys[:, :, start : start + t] = k
            values[:, :, start : start + t] = v
            k, v = keys[:, :, : start + t], values[:, :, : start + t]
            if start > 0:  # query i sits at position start + i: it sees keys up to there
                mask = decoding_mask(start, t, self.sliding_window, x.device)
        out = attend(q, k, v, mask, gqa)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class TransformerBlock(nn.Module):
    """Attention then a feed-forward, each pre-normed and residual. Block ``layer`` is a
    mixture of experts where ``cfg.is_moe_layer(layer)``; its forward then also takes and
    returns the MoE statistics (see ``forge.model.moe``)."""

    feed_forward: FeedForward | MoE
    attention: Attention | LatentAttention

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LatentAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.feed_forward = MoE(cfg, cfg.moe_layers.index(layer))
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask = None,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None = None,
        moe_stats: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if cache is None:  # four inputs, as the tensor-parallel plan expects
            x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        else:
            x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        if isinstance(self.feed_forward, MoE):
            assert moe_stats is not None, "a mixture-of-experts block needs the MoE statistics"
            moe: tuple[torch.Tensor, torch.Tensor] = self.feed_forward(self.ffn_norm(x), moe_stats)
            return x + moe[0], moe[1]
        return x + self.feed_forward(self.ffn_norm(x))


def with_moe_stats(output: Any, stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A mixture-of-experts model's output: what a dense model returns (the logits, hidden
    states, or the chunked loss's three terms) followed by the statistics ``(MoE layers,
    4 + E)`` of every MoE layer the forward passed through, as one flat tuple of tensors (a
    pipeline stage sends its outputs on only as a plain tuple)."""
    parts = output if isinstance(output, tuple) else (output,)
    return (*parts, stats)


def split_moe_output(output: Any, moe: bool) -> tuple[Any, torch.Tensor | None]:
    """``(output, stats)`` of the forward of a model that is a mixture of experts (``moe``),
    or ``(output, None)`` of a dense one."""
    if not moe:
        return output, None
    rest = tuple(output[:-1])
    return (rest[0] if len(rest) == 1 else rest), output[-1]


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` (possibly FSDP-wrapped, or a pipeline stage) has mixture-of-experts
    blocks, so that its forward returns ``with_moe_stats``'s tuple."""
    return isinstance(model, Transformer) and model.cfg.moe


class Transformer(nn.Module):
    """Decoder-only language model returning logits ``(B, T, vocab)``.

    A pipeline stage is the same class with some parts set to None: a stage after the first
    (``embeds_tokens`` false) takes hidden states, without ``output`` it returns them; the last
    stage of a model with multi-token depths keeps a copy of the embedding for them. ``layers``
    is keyed by the global layer index, so a stage's parameter names match the full model's.
    """

    tok_embeddings: nn.Embedding | None
    norm: RMSNorm | None
    output: nn.Linear | None
    mtp: nn.ModuleDict | None
    # distributed.cp: the context-parallel group (``forge.parallel.context_parallel``); the
    # forward then takes this rank's head–tail part of every row
    context_group: ProcessGroup | None = None
    embeds_tokens: bool = True  # false: a pipeline stage after the first (hidden states in)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp = None  # model.mtp_depth: the multi-token prediction depths (forge.model.mtp)
        if cfg.mtp_depth > 0:
            norm = functools.partial(RMSNorm, cfg.dim, cfg.norm_eps)
            self.mtp = nn.ModuleDict(
                {
                    str(k): MTPModule(cfg, norm, TransformerBlock(cfg, cfg.n_layers + k - 1))
                    for k in range(1, cfg.mtp_depth + 1)
                }
            )
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = model_rope_tables(cfg)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.rope_cos.is_meta:  # built on "meta": materialize, then init_weights(seed)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter in place with ``initial_value`` (see there).

        With ``seed`` None the seed is drawn from torch's global generator, so
        ``torch.manual_seed`` before construction still decides the weights. On sharded
        (DTensor) parameters each rank computes only its own shard (``forge.model.init``).
        """
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        for name, p in self.named_parameters():
            key, shape = canonical_name(name), tuple(p.shape)
            fill_(p, functools.partial(initial_value, key, shape, self.cfg, seed))

    def materialize(self, device: torch.device | str) -> None:
        """Allocate a model built on the meta device: storage, tied weights, RoPE tables.

        Parameters are left uninitialised; call ``init_weights`` next.
        """
        self.to_empty(device=device)
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty unties them
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE tables and the MoE layers' buffers (needed after ``to_empty``
        from the meta device)."""
        cos, sin = model_rope_tables(self.cfg)
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()

    def forward(
        self,
        tokens: torch.Tensor,
        moe_stats: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss: LossSpec | None = None,
        cache: KVCache | None = None,
        hidden: bool = False,
        depth_tokens: torch.Tensor | None = None,
    ) -> Any:
        """Token ids ``(B, T)`` (or hidden states on a later pipeline stage) to logits.

        A model with mixture-of-experts blocks returns ``with_moe_stats``'s tuple; a later
        pipeline stage receives the earlier stages' ``moe_stats`` beside the hidden states.

        Packed rows pass per-token ``positions`` (RoPE restarts per document) and
        ``document_ids`` (attention stays within a document). With ``labels`` and a chunked
        ``loss``, returns ``chunked_lm_loss``'s objective, per-token cross-entropy and z term
        instead, never materialising the logits; the loss is computed here, in forward, so
        FSDP2's and the pipeline's hooks see the output weight used as usual. With a ``cache``
        (generation), ``tokens`` continue the cached positions. A model with multi-token
        depths given ``labels`` appends each depth's summed cross-entropy ``(mtp_depth,)``
        (before the MoE statistics), in training mode; they embed ``depth_tokens`` on a
        pipeline's last stage. With ``hidden``, the last block's output (before the final
        norm) instead of logits.
        """
        h = self.tok_embeddings(tokens) if self.embeds_tokens else tokens  # type: ignore[misc]
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:  # (B, 1, T, D/2): one table per row, broadcast over heads
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        mask = self.attention_mask(h.device, tuple(tokens.shape[:2]), document_ids, cache)
        if self.cfg.moe and moe_stats is None:
            moe_stats = empty_stats(self.cfg, h.device)
        start = 0
        if cache is not None:
            start, t = cache.length, tokens.shape[1]
            if start + t > cache.max_len:
                raise ValueError(
                    f"position {start + t} is past model.max_seq_len={cache.max_len}: the "
                    "model has no RoPE positions there; generate fewer tokens"
                )
            cos, sin = cos[start : start + t], sin[start : start + t]
        for i, (name, layer) in enumerate(self.layers.items()):
            layer_cache = None if cache is None else (cache.keys[i], cache.values[i], start)
            if self.cfg.is_moe_layer(int(name)):
                h, moe_stats = layer(h, cos, sin, mask, layer_cache, moe_stats)
            elif cache is None:
                h = layer(h, cos, sin, mask)
            else:
                h = layer(h, cos, sin, mask, layer_cache)
        if cache is not None:
            cache.length += tokens.shape[1]
        depths = None
        if self.mtp is not None and labels is not None and cache is None and self.training:
            ids = tokens if depth_tokens is None else depth_tokens
            depths, moe_stats = depth_losses(
                self, h, ids, labels, (cos, sin), mask, loss, moe_stats
            )
        out = h if hidden else self.head(h, labels, loss)  # hidden: before the final norm
        if depths is not None:
            out = (*(out if isinstance(out, tuple) else (out,)), depths)
        return out if moe_stats is None else with_moe_stats(out, moe_stats)

    def attention_mask(
        self,
        device: torch.device,
        shape: tuple[int, ...],
        document_ids: torch.Tensor | None,
        cache: KVCache | None,
    ) -> AttentionMask:
        """The attention mask every layer of this forward shares (``forge.model.attention``):
        built once here, never per layer. Generation (a ``cache``) always runs SDPA; under
        context parallelism the mask is over the all-gathered keys (``context_mask``)."""
        window = self.cfg.sliding_window
        if self.context_group is not None and cache is None:
            return context_mask(self.context_group, document_ids, shape[1], window, device)
        packed = document_ids is not None
        backend = choose_backend(device.type, packed, self.cfg.attention, window)
        if cache is not None:
            backend = Backend.DENSE_MASK if window else Backend.CAUSAL
        b, t = shape
        return attention_mask(backend, document_ids, (b, t), window, device)

    def head(self, h: torch.Tensor, labels: torch.Tensor | None, loss: LossSpec | None) -> Any:
        """The final norm and output projection (or the chunked loss), where this stage has
        them; else the hidden states."""
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if labels is not None and loss is not None and loss.chunked:
            return chunked_lm_loss(h, self.output.weight, labels, loss)
        return self.output(h)


_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name without the parts wrappers add (activation checkpointing, compile):
    the name checkpoints and initialisation use."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def num_parameters(model: nn.Module) -> int:
    """Unique parameter count (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
