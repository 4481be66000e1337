"""A Hugging Face ``config.json`` read as a forge model: every key checked (types, ranges,
the shapes they imply, the features forge's decoder lacks) before a model is built, each
problem one line naming the file and the key. Pure: no file is read here."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from forge.checkpoint.export import ExportError
from forge.config.sections import ModelConfig

CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_REQUIRED_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
_OPTIONAL_INTS = ("num_key_value_heads", "max_position_embeddings", "head_dim")
_OPTIONAL_NUMBERS = ("rms_norm_eps", "rope_theta", "initializer_range")
_OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_INT_LIMIT = 2**63  # forge's config holds 64-bit integers
JSON_LIMIT = 64 * 2**20  # config.json is kilobytes, an index of 100k tensors megabytes
_POSITIONS_LIMIT = 2**32  # RoPE tables hold a row per position: far beyond any real context
LAYER_INDEX = re.compile(r"^model\.layers\.(\d{1,9})\.")
IGNORED_TENSOR = re.compile(r"\.rotary_emb\.inv_freq$")  # RoPE tables old transformers saved


def shown(value: object, limit: int = 80) -> str:
    """``value`` as a message shows it: a string quoted, anything else as JSON writes it, cut
    to ``limit`` characters (the value comes from the user's file)."""
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def listed(items: Sequence[str], limit: int = 3) -> str:
    """The first ``limit`` items, comma-separated, and how many more there are."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def json_kind(value: object) -> str:
    """What JSON calls ``value``'s type, with an article (for 'expected an object, got ...')."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return kinds.get(type(value), "a number")


def decode_json(data: bytes) -> tuple[object, str | None]:
    """The JSON document in ``data``, or None and why there is none (not UTF-8, empty, not
    JSON, nested beyond what Python's parser follows)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{data[exc.start]:02x} at offset {exc.start}"
        return None, f"not UTF-8 ({where}); save it as UTF-8 JSON"
    if not text.strip():
        return None, "not JSON (the file is empty)"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except RecursionError:
        return None, "not JSON that can be read (nested too deeply)"


def int_problem(key: str, value: object) -> str | None:
    """Why ``value`` is not an integer > 0 that fits in 64 bits, if it is not."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{key}: expected an integer, got {shown(value)}"
    if value >= _INT_LIMIT:
        return f"{key}: {value} is out of range: must fit in 64 bits (< 2**63)"
    if value <= 0:
        return f"{key}: must be > 0, got {value}"
    return None


def number_problem(key: str, value: object) -> str | None:
    """Why ``value`` is not a finite number > 0 (within 64 bits), if it is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key}: expected a number, got {shown(value)}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: expected a finite number, got {shown(value)}"
    if value >= _INT_LIMIT:
        return f"{key}: {value} is out of range: must be < 2**63"
    if value <= 0:
        return f"{key}: must be > 0, got {value}"
    return None


def bool_problem(key: str, value: object) -> str | None:
    """Why ``value`` is not a JSON boolean, if it is not."""
    return None if isinstance(value, bool) else f"{key}: expected true or false, got {shown(value)}"


def given(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``config[key]``, or ``default`` when it is absent or null (as transformers reads it)."""
    value = config.get(key)
    return default if value is None else value


def identity_problems(config: Mapping[str, Any]) -> list[str]:
    """Why ``config`` is not a dense Llama's: another model type or architecture, a mixture of
    experts."""
    model_type = config.get("model_type")
    if "num_local_experts" in config or model_type == "mixtral":
        return [f"a mixture of experts ({model_type}); forge imports dense Llama models only"]
    problems = []
    if model_type is None:
        problems.append("model_type: missing; forge imports Llama models (model_type 'llama')")
    elif model_type != "llama":
        problems.append(
            f"model_type {shown(model_type)}: forge imports Llama models only (model_type "
            "'llama'); another model's weights do not fit forge's decoder"
        )
    arch = config.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        problems.append(f"architectures: expected a list of class names, got {shown(arch)}")
    elif arch is not None and "LlamaForCausalLM" not in arch:
        problems.append(f"architectures {shown(arch)}: forge imports LlamaForCausalLM only")
    return problems


def key_problems(config: Mapping[str, Any]) -> list[str]:
    """Each key forge reads present when required and of its type and range (null, for an
    optional key, means its default)."""
    problems: list[str | None] = [
        f"{key}: missing; a Llama config.json states it"
        for key in _REQUIRED_INTS
        if key not in config
    ]
    checks = [(k, int_problem) for k in (*_REQUIRED_INTS, *_OPTIONAL_INTS)]
    checks += [(k, number_problem) for k in _OPTIONAL_NUMBERS]
    checks += [(k, bool_problem) for k in _OPTIONAL_BOOLS]
    for key, check in checks:
        if key in config and (config[key] is not None or key in _REQUIRED_INTS):
            problems.append(check(key, config[key]))
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{key}: expected a JSON object, got {shown(value)}")
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        problems.append(number_problem("rope_parameters.rope_theta", params["rope_theta"]))
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and _POSITIONS_LIMIT < positions < _INT_LIMIT:
        problems.append(
            f"max_position_embeddings: {positions} is beyond forge's limit of 2**32 positions "
            "(its RoPE tables hold a row per position); lower it to the context the model uses"
        )
    return [p for p in problems if p is not None]


def shape_problems(config: Mapping[str, Any]) -> list[str]:
    """The attention shape forge's decoder can hold: whole heads of an even size, key/value
    heads that divide the query heads (``config``'s keys have passed ``key_problems``)."""
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    if dim % heads:
        return [f"hidden_size {dim} is not divisible by num_attention_heads {heads}"]
    problems = []
    if (dim // heads) % 2:
        problems.append(
            f"the head size hidden_size / num_attention_heads = {dim // heads} is odd; RoPE "
            "rotates pairs of channels, so forge needs it even"
        )
    kv_heads = given(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        problems.append(
            f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
        )
    head_dim = given(config, "head_dim")
    if head_dim is not None and head_dim * heads != dim:
        problems.append(f"head_dim {head_dim} is not hidden_size / num_attention_heads")
    return problems


def rope_problem(config: Mapping[str, Any]) -> str | None:
    """Why a Llama ``config.json``'s RoPE is not forge's plain RoPE, if it is not."""
    params, scaling = given(config, "rope_parameters", {}), given(config, "rope_scaling", {})
    params, scaling = (p if isinstance(p, dict) else {} for p in (params, scaling))
    kinds = {params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")}
    for kind in sorted(k for k in kinds - {None, "default"} if isinstance(k, str)):
        return (
            f"RoPE type {kind!r} (rope scaling) is not implemented by forge, only plain RoPE "
            "('default'); the model's logits would differ"
        )
    return None


def feature_problems(config: Mapping[str, Any]) -> list[str]:
    """What forge's decoder does not have: RoPE scaling, biases, another activation."""
    problems = [p for p in (rope_problem(config),) if p is not None]
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("attention or MLP biases; forge's decoder has none")
    if given(config, "hidden_act", "silu") not in ("silu", "swish"):  # one function in HF
        problems.append(f"hidden_act {shown(config['hidden_act'])}; forge uses 'silu'")
    return problems


def hf_config_problems(config: object, where: str = CONFIG_JSON) -> list[str]:
    """Why ``config`` (a parsed ``config.json``) is not a Llama forge imports, one line per
    problem, each starting with ``where``. Checked in stages (the model type, then each key's
    type, then shapes and features): a later stage's problems follow from an earlier's."""
    if not isinstance(config, dict):
        return [f"{where}: expected a JSON object ({{...}}), got {json_kind(config)}"]
    problems = identity_problems(config) or key_problems(config)
    if not problems:
        problems = shape_problems(config) + feature_problems(config)
    return [f"{where}: {p}" for p in problems]


def model_config_from_llama(config: object, where: str = CONFIG_JSON) -> ModelConfig:
    """The forge ``ModelConfig`` of a Llama ``config.json``; ``ExportError`` with every
    ``hf_config_problems`` line when it is not one forge imports."""
    problems = hf_config_problems(config, where)
    if problems or not isinstance(config, dict):
        raise ExportError(problems)
    params = given(config, "rope_parameters", {})
    cfg = ModelConfig(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=given(config, "num_key_value_heads"),
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"],
        norm_eps=given(config, "rms_norm_eps", 1e-5),
        rope_theta=given(params, "rope_theta", given(config, "rope_theta", 10000.0)),
        max_seq_len=given(config, "max_position_embeddings", 2048),
        tie_embeddings=given(config, "tie_word_embeddings", False),
        init_std=given(config, "initializer_range", 0.02),
    )
    leftover = [f"{where}: gives {key} {message}" for key, message in cfg.problems()]
    if leftover:  # a check forge's config makes that hf_config_problems lacks
        raise ExportError(leftover)
    return cfg
