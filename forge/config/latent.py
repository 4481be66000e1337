"""``[model.mla]``: multi-head latent attention (DeepSeek-V2/V3), the attention kind whose
keys and values come from one low-rank latent per token (docs/training-loop.md#latent-attention)."""

from __future__ import annotations

import attrs

from forge.config.ranges import Problem, non_negative, positive


@attrs.frozen
class LatentConfig:
    """The ranks and head widths of latent attention: the queries through a ``q_rank``
    bottleneck (0: a full projection), keys and values from a ``kv_rank`` latent; each head's
    query and key are ``nope_dim`` channels without position and ``rope_dim`` rotated ones (the
    rotated key is one per token, shared by the heads), its value ``v_dim`` channels. DeepSeek-V3:
    q_rank 1536, kv_rank 512, nope_dim 128, rope_dim 64, v_dim 128."""

    kv_rank: int = 512
    q_rank: int = 0
    nope_dim: int = 128
    rope_dim: int = 64
    v_dim: int = 128

    @property
    def qk_dim(self) -> int:
        """A head's query and key width: its unrotated and rotated channels."""
        return self.nope_dim + self.rope_dim

    @property
    def cached_dim(self) -> int:
        """What the KV cache keeps per token and layer: the latent and the rotated key."""
        return self.kv_rank + self.rope_dim

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        positive(p, "model.mla.kv_rank", self.kv_rank)
        non_negative(p, "model.mla.q_rank", self.q_rank)
        non_negative(p, "model.mla.nope_dim", self.nope_dim)
        positive(p, "model.mla.rope_dim", self.rope_dim)
        positive(p, "model.mla.v_dim", self.v_dim)
        if self.rope_dim > 0 and self.rope_dim % 2:
            p.append(("model.mla.rope_dim", f"must be even for RoPE, got {self.rope_dim}"))
        return p
