"""The Hugging Face family a forge model exports as (``convert_checkpoint.py export``,
``checkpoint.export_final``), and why a model has none. Pure: the config's checks refuse an
export before a run starts; ``forge.checkpoint.hf_families`` names each family's tensors."""

from __future__ import annotations

import enum

from forge.config.model import ModelConfig, MoeRouter


class Family(enum.Enum):
    """A model family by its ``config.json`` ``model_type``."""

    LLAMA = "llama"
    MIXTRAL = "mixtral"
    QWEN3 = "qwen3"
    QWEN3_MOE = "qwen3_moe"

    @property
    def architecture(self) -> str:
        """The transformers class a folder of this family loads as."""
        return _ARCHITECTURES[self]

    @property
    def label(self) -> str:
        """The family's name in messages."""
        return _LABELS[self]

    @property
    def moe(self) -> bool:
        """Whether the family's blocks are mixtures of experts."""
        return self in (Family.MIXTRAL, Family.QWEN3_MOE)

    @property
    def qk_norm(self) -> bool:
        """Whether the family normalises each head's query and key (Qwen3's attention)."""
        return self in (Family.QWEN3, Family.QWEN3_MOE)


_ARCHITECTURES = {
    Family.LLAMA: "LlamaForCausalLM",
    Family.MIXTRAL: "MixtralForCausalLM",
    Family.QWEN3: "Qwen3ForCausalLM",
    Family.QWEN3_MOE: "Qwen3MoeForCausalLM",
}
_LABELS = {
    Family.LLAMA: "Llama",
    Family.MIXTRAL: "Mixtral",
    Family.QWEN3: "Qwen3",
    Family.QWEN3_MOE: "Qwen3-MoE",
}


def export_family(cfg: ModelConfig) -> Family:
    """The family ``cfg`` exports as: Qwen3 with query/key norms, else Llama; their mixture
    of experts (Qwen3-MoE, Mixtral) when any block is one."""
    if cfg.qk_norm:
        return Family.QWEN3_MOE if cfg.moe else Family.QWEN3
    return Family.MIXTRAL if cfg.moe else Family.LLAMA


def export_problem(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` has no export (``export_family``'s), if it has none: one line naming the
    key."""
    if cfg.sliding_window:
        return (
            f"model.sliding_window={cfg.sliding_window}: the Llama, Mixtral and Qwen3 exports "
            "attend to the whole context, so this model has no export; train without a window "
            "to export it"
        )
    if not cfg.moe:
        return None
    family = export_family(cfg)
    arch, label = family.architecture, family.label
    if cfg.moe_router is not MoeRouter.SOFTMAX:
        return (
            f"model.moe_router={cfg.moe_router.value!r}: {arch} routes by a softmax over "
            f"experts, so this model has no {label} export"
        )
    if cfg.moe_shared_experts:
        return (
            f"model.moe_shared_experts: {arch} has no shared experts, so this model has no "
            f"{label} export"
        )
    if family is Family.MIXTRAL and len(cfg.moe_layers) != cfg.n_layers:
        return (
            "model.moe_first_dense / model.moe_every: MixtralForCausalLM has experts in every "
            "block, so a model with dense blocks has no Mixtral export (Qwen3MoeForCausalLM, "
            "the export of a model with model.qk_norm, has them)"
        )
    return None
