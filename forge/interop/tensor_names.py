"""How forge's tensors are named and shaped in a Hugging Face family (its ``FamilySpec``):
one mapping for every family, the spec naming a mixture of experts' block and experts. Pure
(no torch): shapes are checked before a tensor is read.

forge's decoder is each family with some keys set: a Llama (RoPE in the half-split layout of
HF's ``rotate_half``, GQA, SwiGLU, RMSNorm), with query/key norms where the family has them
(Qwen3), with a mixture of experts in the blocks its layout says (Mixtral, Qwen3-MoE); with
latent attention, shared experts and multi-token depths as layers after the model's, named by
the spec (DeepSeek-V3).
"""

from __future__ import annotations

import re

from forge.config.model import ModelConfig
from forge.config.shapes import ROUTER_BIAS, ROUTER_GATE, forge_shapes, mtp_shapes
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


MTP_KEY = re.compile(r"^mtp\.(\d+)\.(.+)$")
_BLOCK = "block."


def block_names(
    layer: str, rest: str, family: FamilySpec, cfg: ModelConfig
) -> tuple[str, ...] | None:
    """The HF tensors of the block tensor ``rest`` (forge's name inside a block) in the
    family's layer ``layer`` (``model.layers.<i>``), or None when the family has no place for
    it: one for most, one per expert for the experts' stacked weights, none for a router's
    balancing bias the family lacks (always 0 under softmax routing)."""
    if rest in _LAYER and (family.qk_norm or rest not in _QK_NORMS):
        return (f"{layer}.{_LAYER[rest]}",)
    if rest in family.layer_names:
        return (f"{layer}.{family.layer_names[rest]}",)
    if family.moe:
        block = f"{layer}.{family.moe_block}"
        expert = EXPERT_WEIGHT.match(rest)
        if expert:
            kind = family.expert_names[expert.group(1)]
            return tuple(f"{block}.experts.{j}.{kind}.weight" for j in range(cfg.moe_num_experts))
        if rest == ROUTER_GATE:
            return (f"{block}.gate.weight",)
        if rest == ROUTER_BIAS:
            return (f"{block}.{family.router_bias}",) if family.router_bias else ()
    return None


def depth_layer(depth: int, cfg: ModelConfig) -> str:
    """The HF layer of multi-token depth ``depth``: the one after the model's layers and the
    depths before it (DeepSeek-V3's numbering)."""
    return f"model.layers.{cfg.n_layers + depth - 1}"


def copies(name: str, family: FamilySpec, cfg: ModelConfig) -> tuple[str, ...]:
    """The copies of forge's top-level tensor ``name`` that each depth's layer holds (the
    embedding and the head, which forge's depths share with the model); the head's come with
    the embedding when the two are tied."""
    shared = (
        [name, "output.weight"]
        if cfg.tie_embeddings and name == "tok_embeddings.weight"
        else [name]
    )
    return tuple(
        f"{depth_layer(k, cfg)}.{family.mtp_copies[n]}"
        for k in range(1, cfg.mtp_depth + 1)
        for n in shared
        if n in family.mtp_copies
    )


def hf_names(name: str, family: FamilySpec, cfg: ModelConfig) -> tuple[str, ...]:
    """The HF tensors forge's tensor ``name`` is in ``family``: the model's first, then any
    copies of it a depth's layer holds (``copies``); one per expert for the experts' stacked
    weights; none for a router's balancing bias the family lacks."""
    names = None
    if name in TOP_TENSORS:
        names = (TOP_TENSORS[name], *copies(name, family, cfg))
    elif m := LAYER_KEY.match(name):
        names = block_names(f"model.layers.{m.group(1)}", m.group(2), family, cfg)
    elif (m := MTP_KEY.match(name)) and family.mtp_names:
        layer, rest = depth_layer(int(m.group(1)), cfg), m.group(2)
        if rest.startswith(_BLOCK):
            names = block_names(layer, rest.removeprefix(_BLOCK), family, cfg)
        elif rest in family.mtp_names:
            names = (f"{layer}.{family.mtp_names[rest]}",)
    if names is None:
        raise ExportError(f"parameter '{name}' has no {family.label} equivalent")
    return names


def block_tensor(name: str) -> str | None:
    """forge's name inside a block for a tensor of a block (the model's or a depth's)."""
    if m := LAYER_KEY.match(name):
        return m.group(2)
    m = MTP_KEY.match(name)
    if m and m.group(2).startswith(_BLOCK):
        return m.group(2).removeprefix(_BLOCK)
    return None


def is_expert_weight(name: str) -> bool:
    """Whether forge's tensor ``name`` stacks every expert's weight ``(E, in, out)``."""
    rest = block_tensor(name)
    return rest is not None and EXPERT_WEIGHT.match(rest) is not None


def all_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s state dict with its shape: the model's, then its depths'."""
    return forge_shapes(cfg) | mtp_shapes(cfg)


def hf_shapes(cfg: ModelConfig, family: FamilySpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s checkpoint in ``family`` with its shape (``lm_head.weight``
    too, which a checkpoint with tied embeddings may leave out)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in all_shapes(cfg).items():
        names = hf_names(name, family, cfg)
        one = (shape[2], shape[1]) if is_expert_weight(name) else shape  # an expert's (out, in)
        shapes |= dict.fromkeys(names, one)
    return shapes
