"""How forge's tensors are named and shaped in a Hugging Face family (its ``FamilySpec``):
one mapping for every family, the spec naming a mixture of experts' block and experts. Pure
(no torch): shapes are checked before a tensor is read.

forge's decoder is each family with some keys set: a Llama (RoPE in the half-split layout of
HF's ``rotate_half``, GQA, SwiGLU, RMSNorm), with query/key norms where the family has them
(Qwen3), with a mixture of experts in the blocks its layout says (Mixtral, Qwen3-MoE).
"""

from __future__ import annotations

import re

from forge.config.model import ModelConfig
from forge.config.shapes import ROUTER_BIAS, ROUTER_GATE, forge_shapes
from forge.errors import UserInputError
from forge.interop.family import FamilySpec


class ExportError(UserInputError):
    """An export cannot be written or read."""


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


def hf_names(name: str, family: FamilySpec, n_experts: int) -> tuple[str, ...]:
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
        block = f"model.layers.{layer}.{family.moe_block}"
        expert = EXPERT_WEIGHT.match(rest)
        if expert:
            kind = family.expert_names[expert.group(1)]
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


def hf_shapes(cfg: ModelConfig, family: FamilySpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s checkpoint in ``family`` with its shape (``lm_head.weight``
    too, which a checkpoint with tied embeddings may leave out)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in forge_shapes(cfg).items():
        names = hf_names(name, family, cfg.moe_num_experts)
        one = (shape[2], shape[1]) if is_expert_weight(name) else shape  # an expert's (out, in)
        shapes |= dict.fromkeys(names, one)
    return shapes
