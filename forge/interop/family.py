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

from forge.config.model import ModelConfig

HfConfig = Mapping[str, Any]  # a parsed config.json whose keys have passed their type checks
ImportRefusal = Callable[[HfConfig], str | None]
ExportRefusal = Callable[[ModelConfig], str | None]


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
    export_refusal: ExportRefusal = no_export_refusal  # after every MoE family's refusals


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
