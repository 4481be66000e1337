"""``convert_checkpoint.py import``: a Hugging Face folder of a family forge imports
(``hf_families``: Llama, Mixtral, Qwen3, Qwen3-MoE; ``config.json`` and ``model.safetensors``,
or a sharded index) read into forge's names, every file, key and tensor
checked first (``hf_config`` for the config): a malformed folder is one line naming the file and
the key or tensor, never a traceback, and nothing is built or allocated from unchecked sizes."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence

import attrs
import torch

from forge.checkpoint.export import require_safetensors
from forge.checkpoint.hf_config import (
    CONFIG_JSON,
    IGNORED_TENSOR,
    JSON_LIMIT,
    LAYER_INDEX,
    WEIGHTS,
    WEIGHTS_INDEX,
    model_config_from_hf,
)
from forge.checkpoint.hf_families import (
    ROUTER_BIAS,
    TOP_TENSORS,
    ExportError,
    forge_shapes,
    hf_names,
    hf_shapes,
    is_expert_weight,
)
from forge.checkpoint.hf_json import counted, decode_json, json_kind, listed, shown
from forge.config.families import Family
from forge.config.sections import ModelConfig
from forge.errors import one_line


@attrs.frozen
class Weights:
    """Where a folder's weights are: ``label`` (``model.safetensors``, or the index of a
    sharded checkpoint) and each file with the tensors to read from it (None: all)."""

    label: pathlib.Path
    files: dict[pathlib.Path, tuple[str, ...] | None]


def folder_problem(folder: pathlib.Path) -> str | None:
    """Why ``folder`` is not a folder to import from, if it is not."""
    if not folder.exists():
        return (
            f"{folder}: no such folder; pass a Hugging Face model folder ({CONFIG_JSON} and "
            f"{WEIGHTS})"
        )
    if not folder.is_dir():
        return f"{folder}: is a file; pass the folder that holds {CONFIG_JSON} and {WEIGHTS}"
    return None


def file_problem(path: pathlib.Path, missing: str) -> str | None:
    """Why ``path`` is not a regular file to read (``missing`` says what to do when it is
    absent), if it is not: a directory, a pipe or a device is never read (it could block)."""
    if path.is_dir():
        return f"{path}: is a directory, not a file"
    if not path.exists():
        return f"{path}: missing; {missing}"
    if not path.is_file():
        return f"{path}: is not a regular file (a pipe, a socket or a device); put the file there"
    return None


def read_json(path: pathlib.Path, missing: str) -> object:
    """The JSON document in ``path``; ``ExportError`` naming it when it is absent (``missing``
    says what to do), not a regular file, too large, unreadable, not UTF-8 or not JSON."""
    problem = file_problem(path, missing)
    if problem is not None:
        raise ExportError(problem)
    try:
        size = path.stat().st_size
        data = path.read_bytes() if size <= JSON_LIMIT else b""
    except OSError as exc:
        raise ExportError(f"{path}: cannot be read ({one_line(exc)})") from exc
    if size > JSON_LIMIT:
        raise ExportError(f"{path}: {size} bytes, beyond the 64 MiB a JSON file of a model holds")
    doc, problem = decode_json(data)
    if problem is not None:
        raise ExportError(f"{path}: {problem}")
    return doc


def plain_file_name(value: object) -> bool:
    """Whether ``value`` names a file in the folder itself (no path, no parent)."""
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in "/\\\0")
    )


def index_problems(doc: object) -> list[str]:
    """Why ``doc`` (a parsed ``model.safetensors.index.json``) does not map tensor names to
    shard files in its folder, if it does not."""
    if not isinstance(doc, dict):
        return [f"expected a JSON object ({{...}}), got {json_kind(doc)}"]
    if "weight_map" not in doc:
        return ["weight_map: missing; a sharded checkpoint's index maps each tensor to its file"]
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        return [
            f"weight_map: expected an object of tensor name: file name, got {json_kind(weight_map)}"
        ]
    bad = [
        f"weight_map[{shown(name)}]: {shown(file)} is not a file name in the folder"
        for name, file in weight_map.items()
        if not plain_file_name(file)
    ]
    return [listed(bad, 1)] if bad else []


def missing_weights_line(folder: pathlib.Path) -> str:
    """The refusal of a folder with neither ``model.safetensors`` nor an index."""
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    hint = (
        f" ({listed(pickled, 1)} is a pickle, which could run code: convert it to safetensors "
        "first)"
        if pickled
        else ""
    )
    return (
        f"{folder / WEIGHTS}: missing, and no sharded {WEIGHTS_INDEX} either; forge imports "
        f"safetensors weights{hint}"
    )


def find_weights(folder: pathlib.Path) -> Weights:
    """``model.safetensors``, or the shards ``model.safetensors.index.json`` lists (each
    checked to be there; a folder holding both is refused); ``ExportError`` naming the file
    otherwise."""
    single, index = folder / WEIGHTS, folder / WEIGHTS_INDEX
    if (single.exists() or single.is_symlink()) and (index.exists() or index.is_symlink()):
        raise ExportError(
            f"{folder}: holds both {WEIGHTS} and {WEIGHTS_INDEX} (a sharded checkpoint); which "
            "is the model is not said: keep the one you mean to import, move the other away"
        )
    if single.exists() or single.is_symlink():
        problem = file_problem(single, "it is a link to nothing")
        if problem is not None:
            raise ExportError(problem)
        return Weights(single, {single: None})
    if not index.exists():
        raise ExportError(missing_weights_line(folder))
    doc = read_json(index, "it is a link to nothing")
    problems = index_problems(doc)
    if problems or not isinstance(doc, dict):
        raise ExportError([f"{index}: {p}" for p in problems])
    shards: dict[str, list[str]] = {}
    for name, file in doc["weight_map"].items():
        shards.setdefault(file, []).append(name)
    absent = [folder / file for file in shards if not (folder / file).is_file()]
    if absent:
        raise ExportError(
            f"{listed([str(p) for p in absent], 2)}: missing; {WEIGHTS_INDEX} lists "
            f"{counted(len(shards), 'shard')}: download the missing ones again"
        )
    return Weights(index, {folder / file: tuple(names) for file, names in shards.items()})


def damaged_line(path: pathlib.Path, exc: Exception) -> str:
    """A safetensors file that does not open or read: one line with its cause."""
    cause = " ".join(str(exc).split())[:200]
    return (
        f"{path}: not a safetensors file, or a damaged one ({cause}); download or export it again"
    )


def read_headers(weights: Weights) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's shape and safetensors dtype (``F32``, ``BF16``, ``F8_E4M3`` ...), from the
    files' headers (no tensor read yet)."""
    from safetensors import SafetensorError, safe_open

    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for path, names in weights.files.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = f.keys()  # a safe_open handle is not iterable
                held = {
                    k: (tuple(f.get_slice(k).get_shape()), str(f.get_slice(k).get_dtype()))
                    for k in keys
                }
        except SafetensorError as exc:
            raise ExportError(damaged_line(path, exc)) from exc
        except OSError as exc:
            raise ExportError(f"{path}: cannot be read ({one_line(exc)})") from exc
        lacking = [n for n in names or () if n not in held]
        if lacking:
            raise ExportError(
                f"{weights.label}: lists {counted(len(lacking), 'tensor')} in {path.name} that "
                f"it does not hold ({listed(lacking)}); the index and its shards disagree"
            )
        headers |= {n: held[n] for n in (names if names is not None else held)}
    return headers


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


def layer_problem(n_layers: int, names: Iterable[str], weights: str) -> str | None:
    """Why the layers the tensor ``names`` hold are not ``0 .. n_layers - 1``, if they are
    not (checked before anything is listed per layer: ``n_layers`` comes from the user)."""
    held = sorted({int(m.group(1)) for n in names if (m := LAYER_INDEX.match(n))})
    whole = bool(held) and len(held) == held[-1] - held[0] + 1  # no gap (never a range built)
    if whole and held[0] == 0 and len(held) == n_layers:
        return None
    which = ""
    if whole:
        which = f" ({held[0]}-{held[-1]})"
    elif held:
        which = f" ({listed([str(i) for i in held], 5)})"
    return (
        f"num_hidden_layers is {n_layers} but {weights} holds "
        f"{counted(len(held), 'layer')}{which}; the weights and config.json are not of one model"
    )


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
    family: Family = Family.LLAMA,
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


def read_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """The tensors of ``weights`` (those the index lists, for a sharded checkpoint)."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path, names in weights.files.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names if names is not None else f.keys():
                    if not IGNORED_TENSOR.search(name):
                        tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, TypeError, ValueError) as exc:
            raise ExportError(damaged_line(path, exc)) from exc
    return tensors


def checked(problems: Sequence[str], where: pathlib.Path | str) -> None:
    """``ExportError`` with each of ``problems`` prefixed by ``where``, if there are any."""
    if problems:
        raise ExportError([f"{where}: {p}" for p in problems])


def forge_state(
    tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, family: Family
) -> dict[str, torch.Tensor]:
    """forge's state dict from a checked folder's fp32 ``tensors``: each renamed, each
    block's experts stacked into forge's ``(E, in, out)`` weights, the routers' balancing
    bias 0 (softmax routing has none), the head the embedding when tied."""
    state = {}
    for name in forge_shapes(cfg):
        names = hf_names(name, family, cfg.moe_num_experts)
        if is_expert_weight(name):
            state[name] = torch.stack([tensors[n].t() for n in names])
        elif name.endswith(ROUTER_BIAS):
            state[name] = torch.zeros(cfg.moe_num_experts)
        elif not (cfg.tie_embeddings and name == "output.weight"):
            state[name] = tensors[names[0]]
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def import_model(folder: pathlib.Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face folder (``config.json`` and ``model.safetensors``, or a sharded
    checkpoint's index and shards) of a family forge imports as forge's config and fp32 state
    dict (the family is ``forge.config.families.export_family`` of the config: an import
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
    cfg, family = model_config_from_hf(raw_config, str(config_path))
    shapes = {n: shape for n, (shape, _) in headers.items()}
    count = (layer_problem(cfg.n_layers, shapes, weights.label.name),)
    if family.moe:
        count += (expert_problem(cfg.moe_num_experts, shapes, weights.label.name),)
    checked([p for p in count if p is not None], config_path)
    expected = hf_shapes(cfg, family)
    checked(tensor_problems(expected, shapes, cfg.tie_embeddings, family), weights.label)
    tensors = read_tensors(weights)
    checked(dtype_problems(tensors), weights.label)
    floats = {k: v.float() for k, v in tensors.items()}
    checked(finite_problems(floats), weights.label)
    return cfg, forge_state(floats, cfg, family)
