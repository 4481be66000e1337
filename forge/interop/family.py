"""One Hugging Face model family as data: everything forge knows of it to import its folders
and to export a model as it. The code that reads and writes the folders (``hf_config``,
``hf_import``, ``export``, ``tensor_names``) is one for every family and reads a spec's
fields, so a new family is one module in ``forge.interop.families`` and its entry in the
registry there (docs/interop.md, "Adding a model family"). Pure: no torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from forge.config.model import ModelConfig, MoeRouter

HfConfig = Mapping[str, Any]  # a parsed config.json whose keys have passed their type checks
ImportRefusal = Callable[[HfConfig], str | None]
ExportRefusal = Callable[[ModelConfig], str | None]
# (axis, order): forge's tensor ``name`` is the HF tensor's rows (axis 0) or columns (axis 1)
# taken in this order, in a folder of this config.json; an export takes the inverse order
Reorder = Callable[[str, ModelConfig, HfConfig], tuple[int, tuple[int, ...]] | None]
Placeholders = Callable[[ModelConfig], dict[str, tuple[int, ...]]]


def no_import_refusal(config: HfConfig) -> str | None:
    """A family that refuses nothing beyond what every family refuses."""
    return None


def no_export_refusal(cfg: ModelConfig) -> str | None:
    """A family that holds every model its ``exports`` rule picks."""
    return None


def no_import_keys(config: HfConfig) -> dict[str, Any]:
    """A dense family: no ``ModelConfig`` key beyond the ones every family reads."""
    return {}


def no_export_keys(cfg: ModelConfig) -> dict[str, Any]:
    """A family whose config.json is Llama's, keys and all."""
    return {}


def no_reorder(name: str, cfg: ModelConfig, config: HfConfig) -> tuple[int, tuple[int, ...]] | None:
    """A family whose tensors hold forge's channels in forge's order."""
    return None


def no_placeholders(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A family whose class holds no empty tensor where forge has none."""
    return {}


def read_only(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A copy no caller can change: one spec is shared by every import and export."""
    return MappingProxyType(dict(mapping))


@attrs.frozen(eq=False)  # a family is itself: compared and hashed by identity
class FamilySpec:
    """A family by its ``config.json`` ``model_type``: what it is, what transformers assumes,
    how its keys and tensors are named and what forge cannot compute exactly of it."""

    model_type: str  # config.json's model_type
    architecture: str  # the transformers class a folder of it loads as
    label: str  # its name in messages
    # the forge models that export as it: the registry's first family whose rule holds
    exports: Callable[[ModelConfig], bool]
    # transformers' value of a key config.json leaves out (the family's config class)
    defaults: Mapping[str, Any] = attrs.field(converter=read_only)
    moe: bool = False  # whether its blocks are mixtures of experts
    qk_norm: bool = False  # whether it normalises each head's query and key
    # config.json keys of its own (beside the ones every family reads) and their types
    ints: tuple[str, ...] = ()
    bools: tuple[str, ...] = ()
    index_lists: tuple[str, ...] = ()  # lists of block indices (Qwen3-MoE's mlp_only_layers)
    # the block holding a mixture of experts, and each expert's name for forge's stacked w1,
    # w2, w3 (each HF expert holds a Linear's (out, in) weight)
    moe_block: str = ""
    expert_names: Mapping[str, str] = attrs.field(default={}, converter=read_only)
    # config.json -> forge's ModelConfig keys beyond the ones every family reads (moe_*)
    import_keys: Callable[[HfConfig], dict[str, Any]] = no_import_keys
    # forge's ModelConfig -> config.json keys beyond Llama's (written over them, then added)
    export_keys: Callable[[ModelConfig], dict[str, Any]] = no_export_keys
    # why config.json's window keys are refused (before the layer_types every family checks)
    window_refusal: ImportRefusal = no_import_refusal
    import_refusal: ImportRefusal = no_import_refusal  # routing, layout: after the window
    export_refusal: ExportRefusal = no_export_refusal  # after what the fields below decide
    # config.json keys of its own that are integers >= 0 (0: none of the thing), and numbers
    counts: tuple[str, ...] = ()
    numbers: tuple[str, ...] = ()
    # what of forge's mixture of experts it holds: the router's scoring, shared experts, a
    # routed scale other than 1, and the name of the router's balancing bias under its
    # ``moe_block`` ("": none, the bias stays 0 as softmax routing has it)
    router: MoeRouter = MoeRouter.SOFTMAX
    shared_experts: bool = False
    routed_scale: bool = False
    router_bias: str = ""
    mla: bool = False  # latent attention ([model.mla]) in place of grouped-query attention
    # a block's tensors of its own beside the ones every family names alike: forge's name in
    # the block -> the family's (latent attention, shared experts)
    layer_names: Mapping[str, str] = attrs.field(default={}, converter=read_only)
    # multi-token depths, as layers after the model's (DeepSeek-V3's form): the config.json
    # key counting them, each depth's own tensors (forge's name in ``mtp.<k>.`` -> the layer's)
    # and the copies each depth's layer holds of the model's tensors (forge's top-level name ->
    # the layer's); no ``mtp_names``: the family has no depths
    mtp_count_key: str = ""
    mtp_names: Mapping[str, str] = attrs.field(default={}, converter=read_only)
    mtp_copies: Mapping[str, str] = attrs.field(default={}, converter=read_only)
    # channels the family orders otherwise (interleaved RoPE pairs), by forge's tensor name
    reorder: Reorder = no_reorder
    # empty tensors its class holds where forge has nothing (zero shared experts): written by
    # an export, taken or not by an import
    placeholders: Placeholders = no_placeholders


def router_keys(cfg: ModelConfig) -> dict[str, Any]:
    """The router's config.json keys every mixture-of-experts family writes: top-k, and
    transformers' balancing loss written as forge's weight but off (forge computes its own)."""
    return {
        "num_experts_per_tok": cfg.moe_top_k,
        "router_aux_loss_coef": cfg.moe_aux_loss_weight,
        "output_router_logits": False,
    }


def family_named(model_type: object, families: Sequence[FamilySpec]) -> FamilySpec | None:
    """The family of ``families`` whose ``model_type`` this is, if any."""
    return next((f for f in families if f.model_type == model_type), None)


def families_line(families: Sequence[FamilySpec]) -> str:
    """The families in messages: 'Llama and Qwen3 models (model_type 'llama', 'qwen3')'."""
    labels = [f.label for f in families]
    named = ", ".join(labels[:-1]) + " and " + labels[-1] if len(labels) > 1 else labels[0]
    types = ", ".join(repr(f.model_type) for f in families)
    return f"{named} models (model_type {types})"
