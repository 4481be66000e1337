"""Qwen3-MoE (``Qwen3MoeForCausalLM``): a Qwen3 whose sparse blocks are Mixtral's experts
(``norm_topk_prob`` true: forge's router renormalises the top-k weights), with dense blocks
where its layout says.

The layout: transformers makes block i sparse when ``(i + 1) % decoder_sparse_step == 0`` and
i is not in ``mlp_only_layers``; forge, after ``moe_first_dense`` dense blocks, makes every
``moe_every``-th sparse. ``sparse_layout`` and ``forge_layout`` map one to the other."""

from __future__ import annotations

from typing import Any

from forge.config.model import ModelConfig
from forge.interop.families.qwen3 import export_keys as qwen3_keys
from forge.interop.families.qwen3 import window_refusal
from forge.interop.family import FamilySpec, HfConfig, router_keys
from forge.interop.hf_json import given, shown

DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
}


def exported(cfg: ModelConfig) -> bool:
    """A mixture of experts with query/key norms."""
    return cfg.qk_norm and cfg.moe


def sparse_layout(cfg: ModelConfig) -> tuple[int, list[int]]:
    """Qwen3-MoE's ``(decoder_sparse_step, mlp_only_layers)`` for ``cfg``'s mixture-of-experts
    blocks. transformers makes block i sparse when ``(i + 1) % step == 0`` and i is not listed:
    forge's layout is that with step ``moe_every`` and its first dense blocks listed when
    ``moe_every`` divides ``moe_first_dense``; else step 1 with every dense block listed."""
    every, first = cfg.moe_every, cfg.moe_first_dense
    if first % every == 0:
        return every, list(range(first))
    return 1, [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]


def forge_layout(n_layers: int, step: int, dense: list[int]) -> tuple[int, int] | None:
    """forge's ``(moe_every, moe_first_dense)`` with the sparse blocks of Qwen3-MoE's
    ``decoder_sparse_step`` = ``step`` and ``mlp_only_layers`` = ``dense`` (``sparse_layout``'s
    inverse), or None when forge's layout has none such. Never lists ``n_layers`` blocks
    (it comes from the file): only as many as ``dense`` holds."""
    listed = sorted({i for i in dense if 0 <= i < n_layers and (i + 1) % step == 0})
    if listed == [(k + 1) * step - 1 for k in range(len(listed))]:  # the first ones dense
        return step, len(listed) * step
    # a longer step that the listed blocks thin the sparse ones out to lists at most as many
    # sparse blocks as listed ones, plus one: past that bound forge's layout cannot be it
    if n_layers // step > 2 * len(listed) + 1:
        return None
    omitted = set(listed)
    blocks = [i for i in range(step - 1, n_layers, step) if i not in omitted]
    if not blocks:
        return None
    every = blocks[1] - blocks[0] if len(blocks) > 1 else blocks[0] + 1
    first = blocks[0] - every + 1
    if first >= 0 and blocks == list(range(first + every - 1, n_layers, every)):
        return every, first
    return None


def sparse_keys(config: HfConfig) -> tuple[int, list[int]]:
    """Qwen3-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``, defaults filled in."""
    step = given(config, "decoder_sparse_step", DEFAULTS["decoder_sparse_step"])
    return step, given(config, "mlp_only_layers", [])


def import_refusal(config: HfConfig) -> str | None:
    """Routing and layout where forge's differ: weights not renormalised, sparse blocks that
    are not forge's layout (``forge_layout``)."""
    if not given(config, "norm_topk_prob", DEFAULTS["norm_topk_prob"]):
        return (
            "norm_topk_prob false (transformers' default when absent): the top-k routing "
            "weights are not renormalised, and forge's router renormalises them; forge "
            "imports Qwen3-MoE with norm_topk_prob true"
        )
    step, dense = sparse_keys(config)
    if forge_layout(config["num_hidden_layers"], step, dense) is None:
        return (
            f"decoder_sparse_step {step} with mlp_only_layers {shown(dense)}: forge places "
            "experts in every model.moe_every-th block after model.moe_first_dense dense "
            "ones, and these sparse blocks are not such a layout"
        )
    return None


def import_keys(config: HfConfig) -> dict[str, Any]:
    """The experts (their count under either name: transformers v5 writes
    ``num_local_experts``, the released models' files ``num_experts``) in the blocks the
    layout makes sparse."""
    experts = given(
        config, "num_experts", given(config, "num_local_experts", DEFAULTS["num_experts"])
    )
    layout = forge_layout(config["num_hidden_layers"], *sparse_keys(config))
    assert layout is not None, "import_refusal refused the layout"
    return {
        "moe_top_k": given(config, "num_experts_per_tok", DEFAULTS["num_experts_per_tok"]),
        "moe_num_experts": experts,
        "moe_hidden_dim": given(config, "moe_intermediate_size", DEFAULTS["moe_intermediate_size"]),
        "moe_every": layout[0],
        "moe_first_dense": layout[1],
    }


def export_keys(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3's windowless attention, the router's keys, and the layout of sparse blocks."""
    step, dense = sparse_layout(cfg)
    return (
        qwen3_keys(cfg)
        | router_keys(cfg)
        | {
            "moe_intermediate_size": cfg.expert_hidden_dim,
            "num_experts": cfg.moe_num_experts,
            "norm_topk_prob": True,  # forge renormalises the top-k weights
            "decoder_sparse_step": step,
            "mlp_only_layers": dense,
        }
    )


QWEN3_MOE = FamilySpec(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    label="Qwen3-MoE",
    exports=exported,
    defaults=DEFAULTS,
    moe=True,
    qk_norm=True,
    ints=(
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
    ),
    bools=("use_sliding_window", "norm_topk_prob"),
    index_lists=("mlp_only_layers",),
    moe_block="mlp",
    expert_names={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
    import_keys=import_keys,
    export_keys=export_keys,
    window_refusal=window_refusal,
    import_refusal=import_refusal,
)
