"""A Hugging Face ``config.json`` read as a forge model of one of the families forge imports
(``forge.interop.families``; one set of checks, reading the family's spec): every key
checked (types, ranges, the shapes they imply, the features forge's decoder lacks) before a
model is built, each problem one line naming the file and the key. Pure: no file is read
here."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from forge.config.sections import ModelConfig, RopeScaling
from forge.interop.families import FAMILIES
from forge.interop.family import FamilySpec, families_line, family_named
from forge.interop.hf_json import (
    INT_LIMIT,
    bool_problem,
    count_problem,
    given,
    int_problem,
    json_kind,
    number_problem,
    shown,
)
from forge.interop.tensor_names import ExportError

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
_LLAMA3_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor")
JSON_LIMIT = 64 * 2**20  # config.json is kilobytes, an index of 100k tensors megabytes
_POSITIONS_LIMIT = 2**32  # RoPE tables hold a row per position: far beyond any real context
LAYER_INDEX = re.compile(r"^model\.layers\.(\d{1,9})\.")
IGNORED_TENSOR = re.compile(r"\.rotary_emb\.inv_freq$")  # RoPE tables old transformers saved


def identity_problems(
    config: Mapping[str, Any], families: Sequence[FamilySpec] = FAMILIES
) -> list[str]:
    """Why ``config`` is not of a family of ``families``: another model type, or an
    architecture other than the family's."""
    model_type = config.get("model_type")
    if model_type is None:
        return [f"model_type: missing; forge imports {families_line(families)}"]
    named = family_named(model_type, families)
    if named is None:
        return [
            f"model_type {shown(model_type)}: forge imports {families_line(families)} only; "
            "another model's weights do not fit forge's decoder"
        ]
    arch = config.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        return [f"architectures: expected a list of class names, got {shown(arch)}"]
    if arch is not None and named.architecture not in arch:
        return [
            f"architectures {shown(arch)}: forge imports model_type {named.model_type!r} as "
            f"{named.architecture} only"
        ]
    return []


def key_problems(config: Mapping[str, Any], family: FamilySpec) -> list[str]:
    """Each key forge reads present when required and of its type and range (null, for an
    optional key, means its default)."""
    problems: list[str | None] = [
        f"{key}: missing; a {family.label} config.json states it"
        for key in _REQUIRED_INTS
        if key not in config
    ]
    ints = (*_REQUIRED_INTS, *_OPTIONAL_INTS, *family.ints)
    checks = [(k, int_problem) for k in ints]
    checks += [(k, count_problem) for k in family.counts]
    checks += [(k, number_problem) for k in (*_OPTIONAL_NUMBERS, *family.numbers)]
    checks += [(k, bool_problem) for k in (*_OPTIONAL_BOOLS, *family.bools)]
    for key, check in checks:
        if key in config and (config[key] is not None or key in _REQUIRED_INTS):
            problems.append(check(key, config[key]))
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{key}: expected a JSON object, got {shown(value)}")
        elif isinstance(value, dict) and value.get("rope_theta") is not None:
            problems.append(number_problem(f"{key}.rope_theta", value["rope_theta"]))
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and _POSITIONS_LIMIT < positions < INT_LIMIT:
        problems.append(
            f"max_position_embeddings: {positions} is beyond forge's limit of 2**32 positions "
            "(its RoPE tables hold a row per position); lower it to the context the model uses"
        )
    problems += list_problems(config, family)
    return [p for p in problems if p is not None]


def list_problems(config: Mapping[str, Any], family: FamilySpec) -> list[str]:
    """The list-valued keys: ``layer_types`` names, the family's lists of block indices
    (Qwen3-MoE's ``mlp_only_layers``)."""
    problems = []
    kinds = config.get("layer_types")
    if kinds is not None and not (
        isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)
    ):
        problems.append(f"layer_types: expected a list of strings, got {shown(kinds)}")
    for key in family.index_lists:
        blocks = config.get(key)
        whole = isinstance(blocks, list) and all(block_index(i) for i in blocks)
        if blocks is not None and not whole:
            problems.append(
                f"{key}: expected a list of block indices (integers >= 0), got {shown(blocks)}"
            )
    return problems


def block_index(value: object) -> bool:
    """Whether ``value`` is a JSON integer >= 0 within 64 bits."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < INT_LIMIT


def head_size(config: Mapping[str, Any], family: FamilySpec) -> int | None:
    """Each head's width as transformers reads it: ``head_dim``, else the family's default
    (Qwen3's 128), else ``hidden_size / num_attention_heads`` (None when not whole)."""
    head = given(config, "head_dim", family.defaults.get("head_dim"))
    if head is not None:
        return head
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    return None if dim % heads else dim // heads


def shape_problems(config: Mapping[str, Any], family: FamilySpec) -> list[str]:
    """The attention shape forge's decoder can hold: whole heads of an even size, key/value
    heads that divide the query heads (``config``'s keys have passed ``key_problems``)."""
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    head = head_size(config, family)
    if head is None:
        return [f"hidden_size {dim} is not divisible by num_attention_heads {heads}"]
    problems = []
    if head % 2 and given(config, "head_dim", family.defaults.get("head_dim")) is None:
        problems.append(
            f"the head size hidden_size / num_attention_heads = {head} is odd; RoPE rotates "
            "pairs of channels, so forge needs it even"
        )
    elif head % 2:
        problems.append(
            f"head_dim {head} is odd; RoPE rotates pairs of channels, so forge needs it even"
        )
    kv_heads = given(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        problems.append(
            f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
        )
    return problems


def rope_entry(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The key transformers reads RoPE's parameters from, and its object: ``rope_scaling``
    when set (v4's key, which v5 still takes first), else ``rope_parameters``."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, dict) and value:
            return key, value
    return "rope_parameters", {}


def rope_kind(rope: Mapping[str, Any]) -> object:
    """RoPE's type in a ``rope_entry`` object (``type``: an older spelling)."""
    return given(rope, "rope_type", given(rope, "type", "default"))


def rope_problems(config: Mapping[str, Any]) -> list[str]:
    """Why the RoPE of ``config`` is neither plain RoPE nor Llama 3.1's scaling with its
    parameters, if it is not."""
    key, rope = rope_entry(config)
    kind = rope_kind(rope)
    partial = given(rope, "partial_rotary_factor", given(config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        return [f"partial_rotary_factor {shown(partial)}: forge rotates every channel of a head"]
    if kind == "default":
        return []
    if kind != "llama3":
        return [
            f"RoPE type {shown(kind)} (rope scaling) is not implemented by forge, only plain "
            "RoPE ('default') and Llama 3.1's ('llama3'); the model's logits would differ"
        ]
    problems: list[str | None] = [
        f"{key}.{name}: missing; a 'llama3' RoPE states it"
        if rope.get(name) is None
        else number_problem(f"{key}.{name}", rope[name])
        for name in _LLAMA3_NUMBERS
    ]
    if rope.get("original_max_position_embeddings") is not None:
        original = rope["original_max_position_embeddings"]
        problems.append(int_problem(f"{key}.original_max_position_embeddings", original))
    return [p for p in problems if p is not None]


def window_problems(config: Mapping[str, Any], family: FamilySpec) -> list[str]:
    """A sliding window, which forge's imports lack: every block attends to the whole
    context (the family's own window keys first)."""
    refusal = family.window_refusal(config)
    if refusal is not None:
        return [refusal]
    kinds = config.get("layer_types") or []
    if any(k != "full_attention" for k in kinds):
        return [f"layer_types {shown(kinds)}: forge's blocks all attend to the whole context"]
    return []


def feature_problems(config: Mapping[str, Any], family: FamilySpec) -> list[str]:
    """What forge's decoder does not have: other RoPE, biases, another activation, a sliding
    window, what the family refuses besides (Qwen3-MoE's routing without renormalisation)."""
    problems = rope_problems(config)
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("attention or MLP biases; forge's decoder has none")
    if given(config, "hidden_act", "silu") not in ("silu", "swish"):  # one function in HF
        problems.append(f"hidden_act {shown(config['hidden_act'])}; forge uses 'silu'")
    refusal = family.import_refusal(config)
    family_problems = [] if refusal is None else [refusal]
    return problems + window_problems(config, family) + family_problems


def hf_config_problems(
    config: object, where: str = CONFIG_JSON, families: Sequence[FamilySpec] = FAMILIES
) -> list[str]:
    """Why ``config`` (a parsed ``config.json``) is not a model of ``families``, one line per
    problem, each starting with ``where``. Checked in stages (the model type, then each key's
    type, then shapes and features): a later stage's problems follow from an earlier's."""
    if not isinstance(config, dict):
        return [f"{where}: expected a JSON object ({{...}}), got {json_kind(config)}"]
    problems = identity_problems(config, families)
    family = family_named(config.get("model_type"), families)
    if not problems and family:  # identity_problems found it
        problems = key_problems(config, family)
        if not problems:
            problems = shape_problems(config, family) + feature_problems(config, family)
    return [f"{where}: {p}" for p in problems]


def rope_of(config: Mapping[str, Any], family: FamilySpec) -> tuple[float, RopeScaling | None]:
    """RoPE's base and scaling as transformers reads them (``rope_entry``'s object first)."""
    _, rope = rope_entry(config)
    theta = given(rope, "rope_theta", given(config, "rope_theta", family.defaults["rope_theta"]))
    if rope_kind(rope) != "llama3":
        return theta, None
    positions = given(config, "max_position_embeddings", family.defaults["max_position_embeddings"])
    return theta, RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=given(rope, "original_max_position_embeddings", positions),
    )


def model_config_from_hf(
    config: object, where: str = CONFIG_JSON, families: Sequence[FamilySpec] = FAMILIES
) -> tuple[ModelConfig, FamilySpec]:
    """The forge ``ModelConfig`` of a ``config.json`` and its family of ``families``;
    ``ExportError`` with every ``hf_config_problems`` line when it is not one forge imports."""
    problems = hf_config_problems(config, where, families)
    if problems or not isinstance(config, dict):
        raise ExportError(problems)
    family = family_named(config["model_type"], families)
    assert family, "identity_problems refused another model type"
    defaults = family.defaults
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    head = head_size(config, family)
    assert head is not None, "shape_problems refused a head size that is not whole"
    theta, scaling = rope_of(config, family)
    keys = {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": given(config, "num_key_value_heads"),
        "head_dim": None if head * heads == dim else head,  # None: dim / n_heads, as forge's own
        "vocab_size": config["vocab_size"],
        "ffn_hidden_dim": config["intermediate_size"],
        "norm_eps": float(given(config, "rms_norm_eps", defaults["rms_norm_eps"])),
        "rope_theta": float(theta),  # JSON's 1000000 is forge's 1000000.0
        "rope_scaling": scaling,
        "max_seq_len": given(
            config, "max_position_embeddings", defaults["max_position_embeddings"]
        ),
        "tie_embeddings": given(config, "tie_word_embeddings", False),
        "init_std": float(given(config, "initializer_range", 0.02)),
        "qk_norm": family.qk_norm,
    }
    # the family's keys over these (latent attention has no key/value heads of its own)
    cfg = ModelConfig(**(keys | family.import_keys(config)))
    leftover = [f"{where}: gives {key} {message}" for key, message in cfg.problems()]
    if leftover:  # a check forge's config makes that hf_config_problems lacks
        raise ExportError(leftover)
    return cfg, family
