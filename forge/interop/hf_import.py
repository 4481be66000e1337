"""``convert_checkpoint.py import``: a Hugging Face folder of a family forge imports
(``forge.interop.families``: Llama, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3; ``config.json`` and
``model.safetensors``, or a sharded index) read into forge's names, every file, key and tensor
checked first (``hf_config`` for the config, ``hf_files`` for the files): a malformed folder
is one line naming the file and the key or tensor, never a traceback, and nothing is built or
allocated from unchecked sizes."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence

import attrs
import torch

from forge.config.sections import ModelConfig
from forge.interop.export import require_safetensors
from forge.interop.families import FAMILIES, LLAMA
from forge.interop.family import FamilySpec
from forge.interop.hf_config import (
    CONFIG_JSON,
    IGNORED_TENSOR,
    LAYER_INDEX,
    model_config_from_hf,
)
from forge.interop.hf_files import (
    find_weights,
    folder_problem,
    read_headers,
    read_json,
    read_tensors,
)
from forge.interop.hf_json import counted, given, listed
from forge.interop.tensor_names import (
    TOP_TENSORS,
    ExportError,
    all_shapes,
    hf_names,
    hf_shapes,
    is_expert_weight,
)

QUANTIZED_DTYPES = ("F8_", "F6_", "F4")  # FP8 (E4M3, E5M2, E8M0 scales), FP6, FP4


def quantized_problems(dtypes: Mapping[str, str], config: Mapping[str, object]) -> list[str]:
    """Why the folder holds a quantized model (FP8 or narrower weights, with or without their
    scale tensors, or a ``quantization_config``): forge trains full-precision weights, and a
    silent upcast of FP8 values without their scales would import numbers off by the scale."""
    narrow = [f"{n}: {d}" for n, d in dtypes.items() if d.startswith(QUANTIZED_DTYPES)]
    declared = "quantization_config" in config
    if not narrow and not declared:  # a "_scale" name alone is no sign: layer scales exist
        return []
    scales = [n for n in dtypes if n.endswith(("_scale_inv", "_scale", ".scales"))]
    what = listed(narrow) if narrow else "config.json's quantization_config"
    with_scales = f", with {counted(len(scales), 'scale tensor')}" if scales else ""
    return [
        f"a quantized model ({what}{with_scales}); forge imports full-precision weights "
        "(F32, BF16, F16): import the model's unquantized release, or dequantize it first"
    ]


def layer_problem(n_layers: int, names: Iterable[str], weights: str, depths: int = 0) -> str | None:
    """Why the layers the tensor ``names`` hold are not ``0 .. n_layers + depths - 1`` (the
    model's, then its multi-token depths'), if they are not (checked before anything is
    listed per layer: ``n_layers`` comes from the user)."""
    held = sorted({int(m.group(1)) for n in names if (m := LAYER_INDEX.match(n))})
    whole = bool(held) and len(held) == held[-1] - held[0] + 1  # no gap (never a range built)
    if whole and held[0] == 0 and len(held) == n_layers + depths:
        return None
    after = f" and {counted(depths, 'multi-token layer')} after them" if depths else ""
    which = ""
    if whole:
        which = f" ({held[0]}-{held[-1]})"
    elif held:
        which = f" ({listed([str(i) for i in held], 5)})"
    return (
        f"num_hidden_layers is {n_layers}{after} but {weights} holds "
        f"{counted(len(held), 'layer')}{which}; the weights and config.json are not of one model"
    )


def with_depths(
    cfg: ModelConfig, family: FamilySpec, config: Mapping[str, object], names: Iterable[str]
) -> tuple[ModelConfig, str | None]:
    """``cfg`` with the multi-token depths the weights hold, as layers after the model's
    (DeepSeek-V3's form; a family without depths has none): their count, and whether their
    blocks are mixtures of experts (``model.mtp_moe``). A folder without them (transformers'
    own save drops them) imports without depths; a count other than ``config.json``'s is
    refused: one line."""
    if not family.mtp_names:
        return cfg, None
    n = cfg.n_layers
    held = {int(m.group(1)) for name in names if (m := LAYER_INDEX.match(name))}
    depth = len([i for i in held if i >= n])
    key = family.mtp_count_key
    declared = given(config, key, family.defaults.get(key, 0))
    if depth not in (0, declared):
        return cfg, (
            f"{key} is {declared} but the weights hold {counted(depth, 'layer')} after the "
            f"model's {n}; the weights and config.json are not of one model"
        )
    experts = f"model.layers.{n}.{family.moe_block}.experts."
    moe = depth > 0 and cfg.moe_num_experts > 0 and any(s.startswith(experts) for s in names)
    return attrs.evolve(cfg, mtp_depth=depth, mtp_moe=moe), None


EXPERT_INDEX = re.compile(r"\.experts\.(\d{1,9})\.")


def expert_problem(n_experts: int, names: Iterable[str], weights: str) -> str | None:
    """Why the experts the tensor ``names`` hold are not ``0 .. n_experts - 1``, if they are
    not (checked before a name is listed per expert: ``n_experts`` comes from the user)."""
    held = sorted({int(m.group(1)) for n in names if (m := EXPERT_INDEX.search(n))})
    if held == list(range(len(held))) and len(held) == n_experts:
        return None
    which = f" ({listed([str(i) for i in held], 5)})" if held else ""
    return (
        f"{counted(n_experts, 'expert')} a block, but {weights} holds "
        f"{counted(len(held), 'expert')}{which}; the weights and config.json are not of one "
        "model"
    )


def tensor_problems(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    tied: bool,
    family: FamilySpec = LLAMA,
) -> list[str]:
    """Tensors ``config.json`` implies that the weights lack, tensors forge has no place for,
    and tensors of another shape (``lm_head.weight`` may be left out when ``tied``)."""
    missing = [
        n for n in expected if n not in found and not (tied and n == TOP_TENSORS["output.weight"])
    ]
    unknown = [n for n in found if n not in expected and not IGNORED_TENSOR.search(n)]
    wrong = [
        f"{n}: shape {list(found[n])}, config.json implies {list(shape)}"
        for n, shape in expected.items()
        if n in found and found[n] != shape
    ]
    problems = []
    if missing:
        problems.append(
            f"missing {counted(len(missing), 'tensor')} config.json implies "
            f"({listed(missing)}); the weights are incomplete, or of another model"
        )
    if unknown:
        problems.append(
            f"{counted(len(unknown), 'tensor')} a {family.label} model forge reads has no place "
            f"for ({listed(unknown)}); forge's decoder has no biases or extra modules"
        )
    if wrong:
        problems.append(
            f"{counted(len(wrong), 'tensor')} of another shape than config.json implies "
            f"({listed(wrong, 2)}); the weights and config.json are not of one model"
        )
    return problems


def dtype_problems(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Tensors that are not floating point (integers, booleans): not weights forge reads."""
    ints = [
        f"{n}: dtype {str(t.dtype).removeprefix('torch.')}"
        for n, t in tensors.items()
        if not t.is_floating_point()
    ]
    if not ints:
        return []
    return [
        f"{counted(len(ints), 'tensor')} not floating point ({listed(ints)}); forge imports "
        "float weights (F32, BF16, F16)"
    ]


def finite_problems(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Tensors holding NaN or infinity: a model that starts from them trains on NaN from its
    first step."""
    bad = [n for n, t in tensors.items() if not bool(torch.isfinite(t).all())]
    if bad:
        return [
            f"{counted(len(bad), 'tensor')} holding NaN or infinity ({listed(bad)}); a model "
            "started from them trains on NaN: import a checkpoint saved before it diverged"
        ]
    return []


def checked(problems: Sequence[str], where: pathlib.Path | str) -> None:
    """``ExportError`` with each of ``problems`` prefixed by ``where``, if there are any."""
    if problems:
        raise ExportError([f"{where}: {p}" for p in problems])


def copy_problems(
    tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, family: FamilySpec
) -> list[str]:
    """The copies of the embedding and the head a depth's layer holds that differ from the
    model's: forge's depths share them, so a depth with its own has no forge model."""
    differ = []
    for name in TOP_TENSORS:
        if cfg.tie_embeddings and name == "output.weight":
            continue  # the head's copies are the embedding's
        first, *rest = hf_names(name, family, cfg)
        differ += [
            f"{n} differs from {first}" for n in rest if not torch.equal(tensors[n], tensors[first])
        ]
    if not differ:
        return []
    return [
        f"{listed(differ, 2)}; forge's multi-token depths share the model's embedding and "
        "output head, so a depth with its own cannot be imported"
    ]


def reordered(tensor: torch.Tensor, order: tuple[int, tuple[int, ...]] | None) -> torch.Tensor:
    """``tensor``'s rows or columns in the order a family's ``reorder`` gives (forge's from
    the family's), or ``tensor`` itself."""
    if order is None:
        return tensor
    axis, index = order
    return tensor.index_select(axis, torch.tensor(index))


def forge_state(
    tensors: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    family: FamilySpec,
    config: Mapping[str, object] | None = None,
) -> dict[str, torch.Tensor]:
    """forge's state dict from a checked folder's fp32 ``tensors`` (of ``config.json``
    ``config``): each renamed and its channels put in forge's order, each block's experts
    stacked into forge's ``(E, in, out)`` weights, a balancing bias the family lacks 0
    (softmax routing has none), the head the embedding when tied."""
    state = {}
    for name in all_shapes(cfg):
        names = hf_names(name, family, cfg)
        if is_expert_weight(name):
            state[name] = torch.stack([tensors[n].t() for n in names])
        elif not names:  # the balancing bias of a family without one
            state[name] = torch.zeros(cfg.moe_num_experts)
        elif not (cfg.tie_embeddings and name == "output.weight"):
            state[name] = reordered(tensors[names[0]], family.reorder(name, cfg, config or {}))
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def import_model(
    folder: pathlib.Path, families: Sequence[FamilySpec] = FAMILIES
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face folder (``config.json`` and ``model.safetensors``, or a sharded
    checkpoint's index and shards) of a family of ``families`` as forge's config and fp32
    state dict (the family is ``export_rules.export_family`` of the config: an import
    exports back as what it was).
    safetensors holds tensors only: nothing in it can run code. Everything is checked before
    a tensor is read (the config, the files, every tensor's name and shape), the values after
    (floating point, finite); each problem is an ``ExportError`` naming the file."""
    require_safetensors()
    problem = folder_problem(folder)
    if problem is not None:
        raise ExportError(problem)
    config_path = folder / CONFIG_JSON
    missing = "a Hugging Face model folder holds config.json beside its weights"
    raw_config = read_json(config_path, missing)
    weights = find_weights(folder)
    headers = read_headers(weights)
    dtypes = {n: d for n, (_, d) in headers.items()}
    plain_config = raw_config if isinstance(raw_config, dict) else {}
    checked(quantized_problems(dtypes, plain_config), weights.label)
    cfg, family = model_config_from_hf(raw_config, str(config_path), families)
    shapes = {n: shape for n, (shape, _) in headers.items()}
    cfg, depths = with_depths(cfg, family, plain_config, shapes)
    count = (depths or layer_problem(cfg.n_layers, shapes, weights.label.name, cfg.mtp_depth),)
    if family.moe:
        count += (expert_problem(cfg.moe_num_experts, shapes, weights.label.name),)
    checked([p for p in count if p is not None], config_path)
    expected = hf_shapes(cfg, family)
    empty = family.placeholders(cfg)  # taken or not: they hold nothing
    found = {n: shape for n, shape in shapes.items() if empty.get(n) != shape}
    checked(tensor_problems(expected, found, cfg.tie_embeddings, family), weights.label)
    tensors = read_tensors(weights)
    checked(dtype_problems(tensors), weights.label)
    floats = {k: v.float() for k, v in tensors.items()}
    checked(finite_problems(floats), weights.label)
    checked(copy_problems(floats, cfg, family), weights.label)
    return cfg, forge_state(floats, cfg, family, plain_config)
