"""FP8 training through torchao (``train.float8``; the optional extra ``fp8``): which linear
layers compute their matrix products in FP8, and their conversion.

The decision is pure and made from the model's shapes (``float8_layers``), so the start-up
line, the tests and the conversion read one rule: a ``Linear`` computes in FP8 unless it is
the output head (its logits set the loss: kept in bf16 by default, as torchao and torchtitan
keep it), a router's gate (a few columns, and the routing it decides is discrete), or one of
its dimensions is not a multiple of 16 (FP8 matrix kernels need that). Mixtures of experts'
stacked experts are no ``Linear`` and stay in bf16. The conversion swaps each chosen layer
for torchao's ``Float8Linear``, which keeps its weight (and so the checkpoint's tensors and
names) in high precision and casts it and its input to FP8 per product: a checkpoint of an
FP8 run loads into a bf16 run and back, and exports, evaluates and generates without torchao.

On a CPU the products run in torchao's emulation (``emulate``): the same scaling and casts,
matrix products in high precision. Applied before tensor parallelism (whose plan then splits
the swapped layers), activation checkpointing, FSDP2 and compile.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Mapping

import attrs
import torch
from torch import nn

from forge.config.loader import ConfigError
from forge.config.sections import Float8Recipe, JobConfig, ModelConfig
from forge.config.shapes import ROUTER_GATE, forge_shapes, mtp_shapes

FP8_MULTIPLE = 16  # FP8 matrix kernels take dimensions that are multiples of this
LEAST_CAPABILITY = (8, 9)  # the first NVIDIA GPUs with FP8 tensor cores (Ada, Hopper)


class Kept(enum.Enum):
    """Why a linear layer stays in high precision."""

    HEAD = "the output head"
    ROUTER = "a router's gate"
    SHAPE = f"a dimension not a multiple of {FP8_MULTIPLE}"


@attrs.frozen
class Float8Layers:
    """The linear layers of a model that compute in FP8, and those kept (with why), by name."""

    converted: tuple[str, ...]
    kept: tuple[tuple[str, Kept], ...]

    def describe(self, recipe: Float8Recipe, emulated: bool, gathered: bool = False) -> str:
        """The start-up line (``gathered``: FSDP2 gathers their weights in FP8)."""
        how = "emulated on a CPU (torchao's emulation: FP8 casts, high-precision products)"
        line = f"float8 {recipe.value}: {len(self.converted)} linear layers in FP8"
        if gathered:
            line += " (their weights gathered in FP8 by FSDP2)"
        if emulated:
            line += f", {how}"
        if self.kept:
            kept = ", ".join(f"{name} ({why.value})" for name, why in self.kept)
            line += f"; kept in high precision: {kept}"
        return line


def kept_reason(name: str, shape: tuple[int, ...]) -> Kept | None:
    """Why the linear layer ``name`` (its weight's ``(out, in)``) stays in high precision,
    or None: it computes in FP8."""
    if name == "output":
        return Kept.HEAD
    if name.endswith(ROUTER_GATE.removesuffix(".weight")):
        return Kept.ROUTER
    if any(size % FP8_MULTIPLE for size in shape):
        return Kept.SHAPE
    return None


def float8_layers(cfg: ModelConfig) -> Float8Layers:
    """``kept_reason`` for every linear layer of ``cfg``'s model (its 2-D weights but the
    embedding), in the model's order."""
    shapes: Mapping[str, tuple[int, ...]] = forge_shapes(cfg) | mtp_shapes(cfg)
    converted: list[str] = []
    kept: list[tuple[str, Kept]] = []
    for key, shape in shapes.items():
        if len(shape) != 2 or key == "tok_embeddings.weight" or not key.endswith(".weight"):
            continue
        name = key.removesuffix(".weight")
        reason = kept_reason(name, shape)
        if reason is None:
            converted.append(name)
        else:
            kept.append((name, reason))
    return Float8Layers(tuple(converted), tuple(kept))


def float8_problem(recipe: Float8Recipe, device: torch.device) -> str | None:
    """Why ``train.float8`` cannot run here, or None: torchao missing, or a GPU without FP8
    tensor cores."""
    if recipe is Float8Recipe.OFF:
        return None
    try:
        import_torchao()
    except ImportError:
        return (
            f"train.float8={recipe.value!r} needs torchao: install the 'fp8' extra "
            "(pip install -e '.[fp8]') or set train.float8='off'"
        )
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < LEAST_CAPABILITY:
            return (
                f"train.float8={recipe.value!r} needs FP8 tensor cores (compute capability "
                f"8.9 or more: Ada, Hopper, Blackwell); this GPU has "
                f"{capability[0]}.{capability[1]}; set train.float8='off'"
            )
    return None


def float8_start_line(
    recipe: Float8Recipe, cfg: ModelConfig, device: torch.device, gathered: bool = False
) -> str | None:
    """The start-up line of ``train.float8`` (None when off; ``gathered``: FSDP2 gathers the
    weights in FP8); raises ``ConfigError`` with ``float8_problem``'s message where it cannot
    run."""
    if (problem := float8_problem(recipe, device)) is not None:
        raise ConfigError(problem)
    if recipe is Float8Recipe.OFF:
        return None
    layers = float8_layers(cfg)
    if not layers.converted:  # on, and inert: no linear layer can take FP8
        raise ConfigError(
            f"train.float8={recipe.value!r}: no linear layer of this model can compute in FP8 "
            f"(each has a dimension not a multiple of {FP8_MULTIPLE}, or is the head or a "
            "router); set train.float8='off' or choose model dimensions that are multiples "
            f"of {FP8_MULTIPLE}"
        )
    return layers.describe(recipe, emulated=device.type != "cuda", gathered=gathered)


def gathers_in_float8(config: JobConfig, fsdp: bool) -> bool:
    """Whether FSDP2 (``fsdp``: the layout shards over data-parallel ranks) gathers the FP8
    layers' weights in FP8 (a byte an element instead of two or four): with tensorwise
    scaling (torchao's FP8 all-gather takes one scale a weight); not under tensor parallelism
    (whose plan would split torchao's weight wrapper), nor with the drift guard (its
    high-precision computation, and its fallback, need the weights gathered in high
    precision), and not yet under a pipeline or replica groups (untried: a stage's scales, a
    heal into the wrapper). The weight is cast with the scale of the whole tensor before the
    gather rather than after it: the same FP8 values, the same step."""
    t, d = config.train, config.distributed
    return (
        t.float8 is Float8Recipe.TENSORWISE
        and fsdp
        and d.tp == 1
        and d.pp == 1
        and t.float8_check == 0
        and not config.fault_tolerance.enabled
    )


def apply_float8(
    model: nn.Module, recipe: Float8Recipe, emulate: bool, all_gather: bool = False
) -> tuple[str, ...]:
    """Swap the linear layers ``float8_layers`` chooses for torchao's ``Float8Linear`` in
    ``recipe``'s scaling (``emulate``: on a CPU; ``all_gather``: their weights gathered in
    FP8, ``gathers_in_float8``); returns their names. A no-op when off."""
    if recipe is Float8Recipe.OFF:
        return ()
    import_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe.value),
        emulate=emulate,
        enable_fsdp_float8_all_gather=all_gather,
    )
    chosen: list[str] = []

    def converts(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if kept_reason(name, tuple(module.weight.shape)) is not None:
            return False
        chosen.append(name)
        return True

    convert_to_float8_training(model, config=config, module_filter_fn=converts)
    return tuple(chosen)


def scales_before_forward(root: nn.Module) -> None:
    """Under the FP8 all-gather, every FP8 weight's scale computed in one all-reduce as
    ``root``'s forward begins (each micro-batch's: a few floats), before FSDP2 gathers any of
    them (else each weight's gather reduces its own). At every forward, not after the
    optimizer alone: a load, a rollback or a heal changes the weights too, and a scale left
    from other weights would cast them wrongly."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute(module: nn.Module, _args: object) -> None:
        precompute_float8_dynamic_scale_for_fsdp(module)

    root.register_forward_pre_hook(precompute, prepend=True)


# loggers that speak while torchao is imported: its GPU kernel libraries that cannot load on
# a CPU machine, and torch on an enum it registers (neither concerns FP8 training)
QUIET_ON_IMPORT = ("torchao", "torch.utils._pytree")


def import_torchao() -> None:
    """Import ``torchao.float8`` without the lines its import prints on a CPU machine."""
    loggers = [logging.getLogger(name) for name in QUIET_ON_IMPORT]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
