"""Mixtral (``MixtralForCausalLM``): a Llama whose every block is a mixture of experts routed
by a softmax top-k, renormalised (forge's router), with no sliding window on import."""

from __future__ import annotations

from typing import Any

from forge.config.model import ModelConfig
from forge.interop.family import FamilySpec, HfConfig, router_keys
from forge.interop.hf_json import given, shown

DEFAULTS = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "max_position_embeddings": 4096 * 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def exported(cfg: ModelConfig) -> bool:
    """A mixture of experts without query/key norms."""
    return not cfg.qk_norm and cfg.moe


def import_keys(config: HfConfig) -> dict[str, Any]:
    """Experts in every block, each as wide as the file's ``intermediate_size``."""
    return {
        "moe_top_k": given(config, "num_experts_per_tok", DEFAULTS["num_experts_per_tok"]),
        "moe_num_experts": given(config, "num_local_experts", DEFAULTS["num_local_experts"]),
        "moe_hidden_dim": config["intermediate_size"],
    }


def export_keys(cfg: ModelConfig) -> dict[str, Any]:
    """The router's keys, the experts' width as ``intermediate_size``, no jitter, no window."""
    return router_keys(cfg) | {
        "intermediate_size": cfg.expert_hidden_dim,
        "num_local_experts": cfg.moe_num_experts,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def window_refusal(config: HfConfig) -> str | None:
    """Mixtral's attention window: forge's blocks attend to the whole context."""
    window = config.get("sliding_window")
    if window is None:
        return None
    return (
        f"sliding_window {shown(window)}: forge imports Mixtral attending to the whole "
        "context (sliding_window null); the model's logits would differ"
    )


def export_refusal(cfg: ModelConfig) -> str | None:
    """Dense blocks: Mixtral's layout has experts in every block."""
    if len(cfg.moe_layers) == cfg.n_layers:
        return None
    return (
        "model.moe_first_dense / model.moe_every: MixtralForCausalLM has experts in every "
        "block, so a model with dense blocks has no Mixtral export (Qwen3MoeForCausalLM, "
        "the export of a model with model.qk_norm, has them)"
    )


MIXTRAL = FamilySpec(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    label="Mixtral",
    exports=exported,
    defaults=DEFAULTS,
    moe=True,
    ints=("num_local_experts", "num_experts_per_tok"),
    moe_block="block_sparse_moe",
    expert_names={"w1": "w1", "w2": "w2", "w3": "w3"},
    import_keys=import_keys,
    export_keys=export_keys,
    window_refusal=window_refusal,
    export_refusal=export_refusal,
)
