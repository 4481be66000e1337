"""``[model]``: the decoder's shape."""

from __future__ import annotations

import attrs

from forge.config.checks import Problem, positive


@attrs.frozen
class ModelConfig:
    """A Llama-style decoder. ``n_kv_heads`` < ``n_heads`` gives grouped-query attention."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    vocab_size: int = 259
    ffn_hidden_dim: int | None = None  # None: 8/3 * dim rounded up to `multiple_of`
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    qk_norm: bool = False  # RMSNorm on each head's query and key (OLMo-2 / Qwen-3 style)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        raw = int(8 * self.dim / 3)
        return self.multiple_of * -(-raw // self.multiple_of)

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            positive(p, f"model.{key}", getattr(self, key))
        positive(p, "model.norm_eps", self.norm_eps)
        positive(p, "model.rope_theta", self.rope_theta)
        positive(p, "model.init_std", self.init_std)
        if self.n_kv_heads is not None:
            positive(p, "model.n_kv_heads", self.n_kv_heads)
        if self.ffn_hidden_dim is not None:
            positive(p, "model.ffn_hidden_dim", self.ffn_hidden_dim)
        if self.n_heads > 0 and self.dim % self.n_heads:
            p.append(("model.dim", f"must be divisible by model.n_heads={self.n_heads}"))
        elif self.n_heads > 0 and (self.dim // self.n_heads) % 2:
            p.append(("model.dim", "dim / n_heads (the head size) must be even for RoPE"))
        if self.n_heads > 0 and self.kv_heads > 0 and self.n_heads % self.kv_heads:
            p.append(("model.n_kv_heads", f"must divide model.n_heads={self.n_heads}"))
        return p
