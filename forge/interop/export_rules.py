"""The Hugging Face family a forge model exports as (``convert_checkpoint.py export``,
``checkpoint.export_final``), and why a model has none. Pure: ``forge.training.setup.problems``
refuses an export before a run starts with the export's own check; each family's rule and
refusals are its spec's (``forge.interop.families``)."""

from __future__ import annotations

from collections.abc import Sequence

from forge.config.model import ModelConfig, MoeRouter
from forge.interop.families import FAMILIES
from forge.interop.family import FamilySpec, families_line
from forge.interop.tensor_names import ExportError


def holder(cfg: ModelConfig, families: Sequence[FamilySpec]) -> FamilySpec | None:
    """The first of ``families`` whose ``exports`` rule holds for ``cfg``, if any."""
    return next((f for f in families if f.exports(cfg)), None)


def no_family_line(families: Sequence[FamilySpec]) -> str:
    """The refusal of a model no family's rule picks (a registry without one that does)."""
    return f"this model has no export: it is none of the {families_line(families)} forge exports"


def export_family(cfg: ModelConfig, families: Sequence[FamilySpec] = FAMILIES) -> FamilySpec:
    """The family ``cfg`` exports as: with the registry's families, DeepSeek-V3 with latent
    attention, Qwen3 with query/key norms, else Llama; their mixture of experts (Qwen3-MoE,
    Mixtral) when any block is one.
    ``ExportError`` when no family's rule picks it."""
    chosen = holder(cfg, families)
    if chosen is None:
        raise ExportError(no_family_line(families))
    return chosen


ROUTING = {
    MoeRouter.SOFTMAX: "a softmax over experts",
    MoeRouter.SIGMOID: "a sigmoid of each expert's score",
}


def export_problem(cfg: ModelConfig, families: Sequence[FamilySpec] = FAMILIES) -> str | None:
    """Why ``cfg`` has no export (``export_family``'s), if it has none: one line naming the
    key. What the family holds is its spec's: latent attention, multi-token depths, its
    router, shared experts, a routed scale; then what it refuses besides."""
    if cfg.sliding_window:
        return (
            f"model.sliding_window={cfg.sliding_window}: the Llama, Mixtral and Qwen3 exports "
            "attend to the whole context, so this model has no export; train without a window "
            "to export it"
        )
    chosen = holder(cfg, families)
    if chosen is None:
        return no_family_line(families)
    arch, label = chosen.architecture, chosen.label
    if cfg.mla is not None and not chosen.mla:
        return f"model.mla: {arch} has no latent attention, so this model has no {label} export"
    if cfg.mtp_depth and not chosen.mtp_names:
        return (
            f"model.mtp_depth={cfg.mtp_depth}: {arch} has no multi-token prediction layers, so "
            f"this model has no {label} export"
        )
    if chosen.moe and cfg.moe_router is not chosen.router:
        return (
            f"model.moe_router={cfg.moe_router.value!r}: {arch} routes by "
            f"{ROUTING[chosen.router]}, so this model has no {label} export"
        )
    if chosen.moe and not chosen.routed_scale and cfg.moe_routed_scale != 1.0:
        return (
            f"model.moe_routed_scale={cfg.moe_routed_scale}: {arch} weighs the chosen experts "
            f"by their normalised scores alone, so this model has no {label} export"
        )
    if chosen.moe and not chosen.shared_experts and cfg.moe_shared_experts:
        return (
            f"model.moe_shared_experts: {arch} has no shared experts, so this model has no "
            f"{label} export"
        )
    return chosen.export_refusal(cfg)


def export_caveats(cfg: ModelConfig, families: Sequence[FamilySpec] = FAMILIES) -> list[str]:
    """What an export of ``cfg`` (one that has one) computes otherwise than forge's model, or
    what its family's engines read otherwise than transformers: exported all the same (the
    weights are the model's), and said in one line each wherever an export is made or
    asked for."""
    chosen = holder(cfg, families)
    if chosen is None or export_problem(cfg, families) is not None:
        return []
    caveats = []
    if chosen.moe and cfg.moe_capacity_factor > 0:
        caveats.append(
            f"model.moe_capacity_factor={cfg.moe_capacity_factor:g}: {chosen.architecture} "
            "computes every expert assignment (dropless), so the export's outputs differ from "
            "this model's wherever capacity drops one"
        )
    if chosen.mtp_names and cfg.mtp_depth and not cfg.mtp_moe:
        caveats.append(
            f"model.mtp_moe=false: {chosen.label}'s inference engines build each multi-token "
            "layer as a mixture of experts, so they misread this model's dense depths "
            "(transformers skips the layers; forge's import reads them back)"
        )
    return caveats
