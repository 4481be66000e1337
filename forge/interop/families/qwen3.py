"""Qwen3 (``Qwen3ForCausalLM``): a Llama with ``model.qk_norm`` (and often a
``model.head_dim`` of its own: 128 beside ``dim / n_heads`` = 64 in the 0.6B), attending to the
whole context in every block."""

from __future__ import annotations

from typing import Any

from forge.config.model import ModelConfig
from forge.interop.family import FamilySpec, HfConfig


def exported(cfg: ModelConfig) -> bool:
    """A dense model with query/key norms."""
    return cfg.qk_norm and not cfg.moe


def export_keys(cfg: ModelConfig) -> dict[str, Any]:
    """No window in any block (transformers' Qwen3 classes read these three keys)."""
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}


def window_refusal(config: HfConfig) -> str | None:
    """Qwen3's (and Qwen3-MoE's) window: forge's blocks attend to the whole context."""
    if not config.get("use_sliding_window"):
        return None
    return (
        "use_sliding_window true: forge imports Qwen3 attending to the whole context in "
        "every block; the model's logits would differ"
    )


QWEN3 = FamilySpec(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    label="Qwen3",
    exports=exported,
    defaults={
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "head_dim": 128,
    },
    qk_norm=True,
    bools=("use_sliding_window",),
    export_keys=export_keys,
    window_refusal=window_refusal,
)
