"""Llama (2, 3.x; ``LlamaForCausalLM``): forge's decoder with no key beyond its shape. RoPE
in the half-split layout of HF's ``rotate_half``, GQA, SwiGLU, RMSNorm; Llama 3.1's ``llama3``
RoPE scaling is ``model.rope_scaling``, read and written for every family alike."""

from __future__ import annotations

from typing import Any

from forge.config.model import ModelConfig
from forge.interop.family import FamilySpec


def exported(cfg: ModelConfig) -> bool:
    """A dense model without query/key norms: nothing of it is another family's."""
    return not cfg.qk_norm and not cfg.moe


def export_keys(cfg: ModelConfig) -> dict[str, Any]:
    """Llama's own key (the other families' config classes have no ``mlp_bias``)."""
    return {"mlp_bias": False}


LLAMA = FamilySpec(
    model_type="llama",
    architecture="LlamaForCausalLM",
    label="Llama",
    exports=exported,
    defaults={"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    export_keys=export_keys,
)
