"""How each Hugging Face family forge converts to and from (``forge.config.families``) names
forge's tensors and lays out their shapes, and what transformers assumes of a key
``config.json`` leaves out. Pure (no torch): shapes are checked before a tensor is read.

forge's decoder is each of them with some keys set: a Llama (RoPE in the half-split layout of
HF's ``rotate_half``, GQA, SwiGLU, RMSNorm); a Mixtral is a Llama whose every block is a
mixture of experts routed by a softmax top-k, renormalised; a Qwen3 is a Llama with
``model.qk_norm`` (and often its own ``model.head_dim``); a Qwen3-MoE is a Qwen3 whose blocks
are Mixtral's experts (``norm_topk_prob`` true), with dense blocks where its layout says.
"""

from __future__ import annotations

import re
from typing import Any

from forge.config.families import Family
from forge.config.model import ModelConfig
from forge.errors import UserInputError


class ExportError(UserInputError):
    """An export cannot be written or read."""


FAMILIES_LINE = (
    "Llama, Mixtral, Qwen3 and Qwen3-MoE models (model_type 'llama', 'mixtral', 'qwen3', "
    "'qwen3_moe')"
)
# what transformers assumes of a key config.json leaves out (each family's config class)
DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.LLAMA: {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    Family.MIXTRAL: {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096 * 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    Family.QWEN3: {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "head_dim": 128,
    },
    Family.QWEN3_MOE: {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
    },
}

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QK_NORMS = frozenset({"attention.q_norm.weight", "attention.k_norm.weight"})
TOP_TENSORS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# the block that holds a mixture of experts, and each expert's names for forge's stacked
# (E, in, out) weights (each HF expert holds a Linear's (out, in) weight)
_MOE_BLOCK = {Family.MIXTRAL: "block_sparse_moe", Family.QWEN3_MOE: "mlp"}
_EXPERT_NAMES = {
    Family.MIXTRAL: {"w1": "w1", "w2": "w2", "w3": "w3"},
    Family.QWEN3_MOE: {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
}
ROUTER_GATE = "feed_forward.router.gate.weight"
ROUTER_BIAS = "feed_forward.router.expert_bias"  # 0 under softmax routing: never exported
EXPERT_WEIGHT = re.compile(r"^feed_forward\.experts\.(w[123])$")
LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    """forge parameter name → HF name, for the tensors every family names alike (all but a
    mixture of experts' router and experts)."""
    if name in TOP_TENSORS:
        return TOP_TENSORS[name]
    m = LAYER_KEY.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ExportError(f"parameter '{name}' has no Llama equivalent")


def forge_name(name: str) -> str:
    """HF name → forge parameter name (``hf_name``'s inverse)."""
    for ours, theirs in TOP_TENSORS.items():
        if name == theirs:
            return ours
    m = _HF_LAYER_KEY.match(name)
    if m:
        for ours, theirs in _LAYER.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
    raise ExportError(f"tensor '{name}' is not part of a Llama model forge can read")


def hf_names(name: str, family: Family, n_experts: int) -> tuple[str, ...]:
    """The HF tensors forge's tensor ``name`` is in ``family``: one for most, one per expert
    for the experts' stacked weights (``n_experts`` of them), none for the router's balancing
    bias (always 0 under softmax routing, the only routing exported)."""
    m = LAYER_KEY.match(name)
    if m is None:
        if name in TOP_TENSORS:
            return (TOP_TENSORS[name],)
        raise ExportError(f"parameter '{name}' has no {family.label} equivalent")
    layer, rest = m.groups()
    if rest in _LAYER and (family.qk_norm or rest not in _QK_NORMS):
        return (f"model.layers.{layer}.{_LAYER[rest]}",)
    if family.moe:
        block = f"model.layers.{layer}.{_MOE_BLOCK[family]}"
        expert = EXPERT_WEIGHT.match(rest)
        if expert:
            kind = _EXPERT_NAMES[family][expert.group(1)]
            return tuple(f"{block}.experts.{j}.{kind}.weight" for j in range(n_experts))
        if rest == ROUTER_GATE:
            return (f"{block}.gate.weight",)
        if rest == ROUTER_BIAS:
            return ()
    raise ExportError(f"parameter '{name}' has no {family.label} equivalent")


def is_expert_weight(name: str) -> bool:
    """Whether forge's tensor ``name`` stacks every expert's weight ``(E, in, out)``."""
    m = LAYER_KEY.match(name)
    return m is not None and EXPERT_WEIGHT.match(m.group(2)) is not None


def forge_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s state dict with its shape, by hand (no model is built: the
    sizes may come from a file not yet checked against its weights)."""
    dim, head = cfg.dim, cfg.head_size
    q, kv = cfg.n_heads * head, cfg.kv_heads * head
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, dim)}
    for i in range(cfg.n_layers):
        block = {
            "attention_norm.weight": (dim,),
            "attention.wq.weight": (q, dim),
            "attention.wk.weight": (kv, dim),
            "attention.wv.weight": (kv, dim),
            "attention.wo.weight": (dim, q),
        }
        if cfg.qk_norm:
            block |= {"attention.q_norm.weight": (head,), "attention.k_norm.weight": (head,)}
        block["ffn_norm.weight"] = (dim,)
        block |= feed_forward_shapes(cfg, i)
        shapes |= {f"layers.{i}.{name}": shape for name, shape in block.items()}
    return shapes | {"norm.weight": (dim,), "output.weight": (cfg.vocab_size, dim)}


def feed_forward_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Block ``layer``'s feed-forward tensors: a SwiGLU's, or a router's and the experts'."""
    dim = cfg.dim
    if not cfg.is_moe_layer(layer):
        hidden = cfg.hidden_dim
        return {
            "feed_forward.w1.weight": (hidden, dim),
            "feed_forward.w2.weight": (dim, hidden),
            "feed_forward.w3.weight": (hidden, dim),
        }
    experts, hidden = cfg.moe_num_experts, cfg.expert_hidden_dim
    shapes = {
        ROUTER_GATE: (experts, dim),
        ROUTER_BIAS: (experts,),
        "feed_forward.experts.w1": (experts, dim, hidden),
        "feed_forward.experts.w2": (experts, hidden, dim),
        "feed_forward.experts.w3": (experts, dim, hidden),
    }
    if cfg.moe_shared_experts:
        shared = cfg.moe_shared_experts * hidden
        shapes |= {
            "feed_forward.shared.w1.weight": (shared, dim),
            "feed_forward.shared.w2.weight": (dim, shared),
            "feed_forward.shared.w3.weight": (shared, dim),
        }
    return shapes


def hf_shapes(cfg: ModelConfig, family: Family) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s checkpoint in ``family`` with its shape (``lm_head.weight``
    too, which a checkpoint with tied embeddings may leave out)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in forge_shapes(cfg).items():
        names = hf_names(name, family, cfg.moe_num_experts)
        one = (shape[2], shape[1]) if is_expert_weight(name) else shape  # an expert's (out, in)
        shapes |= dict.fromkeys(names, one)
    return shapes


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
