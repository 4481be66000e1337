"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention (``[model.mla]``), a
mixture of experts in every block after ``first_k_dense_replace`` dense ones (forge's
``moe_first_dense``), routed by a sigmoid whose score-correction bias
(``e_score_correction_bias``) is forge's balancing bias (``expert_bias``), group-limited
(``n_group`` / ``topk_group``), the chosen weights renormalised and scaled by
``routed_scaling_factor``, shared experts beside them; and the multi-token prediction layers
in DeepSeek's own naming (``model.layers.<num_hidden_layers + k - 1>``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head``, its copy of the embedding), which transformers does not load.

Where transformers' class differs from forge's decoder, and what is done about it:

- RoPE pairs: with ``rope_interleave`` (its default, and the release's) the rotated channels
  are interleaved pairs (x0, x1), (x2, x3), ...; forge rotates the first half against the
  second. Both are one rotation once the rotated rows of the query projection and of
  ``kv_a_proj_with_mqa`` are put evens first, then odds (``reorder``); the product of a
  query and a key is then the same.
- the latent norms (``q_a_layernorm``, ``kv_a_layernorm``) use eps 1e-6 whatever
  ``rms_norm_eps`` says, forge's ``model.norm_eps``: only 1e-6 is one model on both sides.
- the attention scale is 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), as forge's; YaRN
  (the release's ``rope_scaling``) changes it by its mscale and the RoPE frequencies too,
  which forge does not compute: refused with every other RoPE type forge lacks.
- the depth's input: ``eh_proj`` takes concat(enorm(embedding), hnorm(hidden)), forge's
  ``proj`` concat(hidden_norm(hidden), embed_norm(embedding)): its columns swap halves.
- zero shared experts: transformers still builds them, zero wide (``placeholders``).
"""

from __future__ import annotations

import re
from typing import Any

from forge.config.latent import LatentConfig
from forge.config.model import ModelConfig, MoeRouter
from forge.interop.family import FamilySpec, HfConfig, router_keys
from forge.interop.hf_json import given, shown

LATENT_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps says
DEFAULTS = {  # DeepseekV3Config's
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
}
QUERY = re.compile(r"(^|\.)attention\.(wq|wq_b)\.weight$")
LATENT = re.compile(r"(^|\.)attention\.wkv_a\.weight$")
DEPTH_PROJ = re.compile(r"^mtp\.\d+\.proj\.weight$")


def exported(cfg: ModelConfig) -> bool:
    """A model with latent attention."""
    return cfg.mla is not None


def q_rank(config: HfConfig) -> int:
    """``q_lora_rank`` as forge's ``model.mla.q_rank``: null is a full query projection (0),
    an absent key transformers' default."""
    if "q_lora_rank" not in config:
        return DEFAULTS["q_lora_rank"]
    return config["q_lora_rank"] or 0


def of(config: HfConfig, key: str) -> Any:
    """``config[key]``, or transformers' default when it is absent or null."""
    return given(config, key, DEFAULTS[key])


def import_keys(config: HfConfig) -> dict[str, Any]:
    """Latent attention (no key/value heads of its own: forge's ``head_dim`` and
    ``n_kv_heads`` unset) and the mixture of experts after the first dense blocks."""
    return {
        "n_kv_heads": None,
        "head_dim": None,
        "mla": LatentConfig(
            kv_rank=of(config, "kv_lora_rank"),
            q_rank=q_rank(config),
            nope_dim=of(config, "qk_nope_head_dim"),
            rope_dim=of(config, "qk_rope_head_dim"),
            v_dim=of(config, "v_head_dim"),
        ),
        "moe_num_experts": of(config, "n_routed_experts"),
        "moe_top_k": of(config, "num_experts_per_tok"),
        "moe_hidden_dim": of(config, "moe_intermediate_size"),
        "moe_shared_experts": of(config, "n_shared_experts"),
        "moe_first_dense": of(config, "first_k_dense_replace"),
        "moe_every": 1,
        "moe_router": MoeRouter.SIGMOID,
        "moe_num_groups": of(config, "n_group"),
        "moe_top_groups": of(config, "topk_group"),
        "moe_routed_scale": float(of(config, "routed_scaling_factor")),
    }


def export_keys(cfg: ModelConfig) -> dict[str, Any]:
    """The latent attention's ranks and widths, the router's keys, the layout, the depths;
    RoPE pairs interleaved as the release has them (``reorder`` permutes the rows so)."""
    m = cfg.mla
    assert m is not None, "exported picks models with latent attention"
    return router_keys(cfg) | {
        "num_key_value_heads": cfg.n_heads,  # every head expands its own keys and values
        "head_dim": m.rope_dim,  # transformers' own value: its RoPE tables' width
        "kv_lora_rank": m.kv_rank,
        "q_lora_rank": m.q_rank or None,  # null: one query projection
        "qk_nope_head_dim": m.nope_dim,
        "qk_rope_head_dim": m.rope_dim,
        "v_head_dim": m.v_dim,
        "rope_interleave": True,
        "n_routed_experts": cfg.moe_num_experts,
        "moe_intermediate_size": cfg.expert_hidden_dim,
        "n_shared_experts": cfg.moe_shared_experts,
        "first_k_dense_replace": cfg.moe_first_dense,
        "n_group": cfg.moe_num_groups,
        "topk_group": cfg.moe_top_groups,
        "norm_topk_prob": True,  # forge renormalises the chosen weights
        "routed_scaling_factor": cfg.moe_routed_scale,
        "num_nextn_predict_layers": cfg.mtp_depth,
        # DeepSeek's own keys, which its reference code reads (transformers computes these)
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
    }


def import_refusal(config: HfConfig) -> str | None:
    """What forge's decoder computes otherwise: weights not renormalised, latent norms whose
    eps is not the model's, key/value heads other than the heads."""
    if not of(config, "norm_topk_prob"):
        return (
            "norm_topk_prob false: the chosen experts' weights are not renormalised, and "
            "forge's router renormalises them; forge imports DeepSeek-V3 with norm_topk_prob true"
        )
    eps = given(config, "rms_norm_eps", DEFAULTS["rms_norm_eps"])
    if eps != LATENT_EPS:
        return (
            f"rms_norm_eps {shown(eps)}: DeepseekV3ForCausalLM normalises the latents "
            "(q_a_layernorm, kv_a_layernorm) with eps 1e-6 whatever rms_norm_eps says, and "
            "forge every norm with one eps; forge imports DeepSeek-V3 with rms_norm_eps 1e-6"
        )
    heads = config["num_attention_heads"]
    kv_heads = given(config, "num_key_value_heads", heads)
    if kv_heads != heads:
        return (
            f"num_key_value_heads {kv_heads}: latent attention expands keys and values for "
            f"every head; forge imports DeepSeek-V3 with num_key_value_heads = "
            f"num_attention_heads ({heads})"
        )
    return None


def export_refusal(cfg: ModelConfig) -> str | None:
    """A layout DeepSeek-V3 has no keys for (dense, or experts not in every block after the
    dense ones), latent norms of another eps."""
    if not cfg.moe:
        return (
            "model.moe_num_experts=0: DeepseekV3ForCausalLM's blocks after "
            "first_k_dense_replace are mixtures of experts, so a dense model with [model.mla] "
            "has no DeepSeek-V3 export"
        )
    if cfg.moe_every != 1:
        return (
            f"model.moe_every={cfg.moe_every}: DeepseekV3ForCausalLM has experts in every block "
            "after the first model.moe_first_dense (first_k_dense_replace), so this model has "
            "no DeepSeek-V3 export"
        )
    if cfg.norm_eps != LATENT_EPS:
        return (
            f"model.norm_eps={cfg.norm_eps}: DeepseekV3ForCausalLM normalises the latents with "
            "eps 1e-6 whatever rms_norm_eps says, so this model has no DeepSeek-V3 export; "
            "train with model.norm_eps = 1e-6 to export it"
        )
    return None


def pairs_to_halves(rope: int) -> tuple[int, ...]:
    """forge's rotated channels from interleaved pairs: the even channels, then the odd (the
    pair (x2i, x2i+1) becomes forge's (x_i, x_{i + rope/2}), which forge rotates alike)."""
    return (*range(0, rope, 2), *range(1, rope, 2))


def reorder(name: str, cfg: ModelConfig, config: HfConfig) -> tuple[int, tuple[int, ...]] | None:
    """forge's channels from DeepSeek-V3's: the depth's projection's input halves swapped
    (DeepSeek joins the embedding first); with ``rope_interleave``, the rotated rows of the
    query projection (each head's last ``rope_dim``) and of ``kv_a_proj_with_mqa`` (after the
    latent) evens first, then odds."""
    if DEPTH_PROJ.match(name):
        return 1, (*range(cfg.dim, 2 * cfg.dim), *range(cfg.dim))
    m = cfg.mla
    if m is None or not of(config, "rope_interleave"):
        return None
    rotated = pairs_to_halves(m.rope_dim)
    if QUERY.search(name):
        head = (*range(m.nope_dim), *(m.nope_dim + i for i in rotated))
        return 0, tuple(h * m.qk_dim + i for h in range(cfg.n_heads) for i in head)
    if LATENT.search(name):
        return 0, (*range(m.kv_rank), *(m.kv_rank + i for i in rotated))
    return None


def placeholders(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """With no shared experts, the zero-wide ones transformers builds in every mixture of
    experts (``moe_intermediate_size × n_shared_experts`` = 0): its save writes them, its load
    expects them."""
    if cfg.moe_shared_experts:
        return {}
    shapes: dict[str, tuple[int, ...]] = {}
    for i in cfg.moe_layers:  # the depths' blocks too: their HF layer index is theirs
        shared = f"model.layers.{i}.mlp.shared_experts"
        shapes |= {
            f"{shared}.gate_proj.weight": (0, cfg.dim),
            f"{shared}.up_proj.weight": (0, cfg.dim),
            f"{shared}.down_proj.weight": (cfg.dim, 0),
        }
    return shapes


DEEPSEEK_V3 = FamilySpec(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    label="DeepSeek-V3",
    exports=exported,
    defaults=DEFAULTS,
    moe=True,
    ints=(
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_group",
        "topk_group",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "v_head_dim",
    ),
    counts=(
        "n_shared_experts",
        "first_k_dense_replace",
        "qk_nope_head_dim",
        "num_nextn_predict_layers",
    ),
    numbers=("routed_scaling_factor",),
    bools=("norm_topk_prob", "rope_interleave"),
    moe_block="mlp",
    expert_names={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
    import_keys=import_keys,
    export_keys=export_keys,
    import_refusal=import_refusal,
    export_refusal=export_refusal,
    router=MoeRouter.SIGMOID,
    shared_experts=True,
    routed_scale=True,
    router_bias="gate.e_score_correction_bias",
    mla=True,
    layer_names={
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
        "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    },
    mtp_count_key="num_nextn_predict_layers",
    mtp_names={
        "hidden_norm.weight": "hnorm.weight",
        "embed_norm.weight": "enorm.weight",
        "proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight",
    },
    mtp_copies={
        "tok_embeddings.weight": "embed_tokens.weight",
        "output.weight": "shared_head.head.weight",
    },
    reorder=reorder,
    placeholders=placeholders,
)
