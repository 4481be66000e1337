"""Multi-head latent attention (DeepSeek-V2/V3; ``[model.mla]``): each token's keys and values
come from one low-rank latent, and the position enters through a few rotated channels apart.

Per token: ``wkv_a`` maps the hidden state to a ``kv_rank`` latent (RMS-normed) and one
``rope_dim`` key shared by every head, rotated by position; ``wkv_b`` expands the latent to each
head's unrotated key (``nope_dim``) and value (``v_dim``). The queries go through a ``q_rank``
bottleneck (``wq_a``, RMSNorm, ``wq_b``; or one ``wq`` when ``q_rank`` is 0) to each head's
``nope_dim + rope_dim`` channels, the last ``rope_dim`` rotated. A head's score is over the
``nope_dim + rope_dim`` channels (SDPA's scale, ``1 / sqrt(nope_dim + rope_dim)``).

The KV cache keeps the latent and the rotated key only, ``kv_rank + rope_dim`` values a token
and layer (GQA keeps ``2 × kv_heads × head_dim``); each forward expands the cached latents.

Parameter names (checkpoint keys): ``attention.{wq_a, q_a_norm, wq_b | wq, wkv_a, kv_norm,
wkv_b, wo}``.
"""

from __future__ import annotations

import torch
from torch import nn

from forge.config.model import ModelConfig
from forge.model.attention import AttentionMask, attend, decoding_mask
from forge.model.layers import RMSNorm, apply_rope


class LatentAttention(nn.Module):
    """Latent attention in place of ``Attention``: the same forward."""

    wq: nn.Linear | None
    wq_a: nn.Linear | None
    q_a_norm: RMSNorm | None
    wq_b: nn.Linear | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None, "latent attention needs [model.mla]"
        heads = cfg.n_heads
        self.m, self.sliding_window = m, cfg.sliding_window
        self.wq = self.wq_a = self.q_a_norm = self.wq_b = None
        if m.q_rank > 0:
            self.wq_a = nn.Linear(cfg.dim, m.q_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(m.q_rank, heads * m.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * m.qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, m.kv_rank + m.rope_dim, bias=False)
        self.kv_norm = RMSNorm(m.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(m.kv_rank, heads * (m.nope_dim + m.v_dim), bias=False)
        self.wo = nn.Linear(heads * m.v_dim, cfg.dim, bias=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Each head's query channels ``(B, T, H · (nope_dim + rope_dim))``."""
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.q_a_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_a_norm(self.wq_a(x)))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask = None,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """As ``Attention.forward``; a ``cache``'s keys hold each position's latent and
        rotated key (its values are unused)."""
        m = self.m
        b, t, _ = x.shape
        if cos.dim() == 2:
            cos, sin = cos[:t], sin[:t]
        q = self.queries(x).view(b, t, -1, m.qk_dim).transpose(1, 2)
        q_nope, q_rot = q.split([m.nope_dim, m.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rot, cos, sin)], dim=-1)
        latent, k_rot = self.wkv_a(x).split([m.kv_rank, m.rope_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rot = apply_rope(k_rot[:, None], cos, sin)  # (B, 1, T, rope_dim): one for every head
        if cache is not None:
            keys, _, start = cache
            keys[:, 0, start : start + t] = torch.cat([latent, k_rot[:, 0]], dim=-1)
            latent, rot = keys[:, 0, : start + t].split([m.kv_rank, m.rope_dim], dim=-1)
            k_rot = rot[:, None]
            if start > 0:  # query i sits at position start + i: it sees keys up to there
                mask = decoding_mask(start, t, self.sliding_window, x.device)
        s = latent.shape[1]
        kv = self.wkv_b(latent).view(b, s, -1, m.nope_dim + m.v_dim).transpose(1, 2)
        k_nope, v = kv.split([m.nope_dim, m.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out = attend(q, k, v, mask, False)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))
