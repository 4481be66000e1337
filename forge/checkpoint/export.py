"""Model-only export in Hugging Face Llama layout: ``model.safetensors`` plus ``config.json``.

forge's decoder is a Llama (RoPE in the half-split layout of HF's ``rotate_half``, GQA,
SwiGLU, RMSNorm), so the export is a rename and a dtype cast; it loads into
``LlamaForCausalLM`` and back into forge. A mixture of experts with Mixtral's routing (softmax
top-k, renormalised, in every block, no shared experts) exports to ``MixtralForCausalLM``
instead, one ``w1/w2/w3`` per expert (the layout transformers v4 reads and v5 converts). Needs
the optional ``safetensors`` package (``pip install 'forge[safetensors]'``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import pathlib
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from forge.checkpoint.hf_tokenizer import BYTE_SPECIAL_TOKENS, byte_tokenizer_json, tokenizer_config
from forge.config.sections import ModelConfig, MoeRouter
from forge.errors import UserInputError, one_line
from forge.outputs import OutputKind, replace_output, staged_output

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_EXPERTS = {  # forge's (E, in, out) weight → Mixtral's per-expert (out, in) Linear weight
    "feed_forward.experts.w1": "w1",
    "feed_forward.experts.w2": "w2",
    "feed_forward.experts.w3": "w3",
}
_MOE_GATE = ("feed_forward.router.gate.weight", "block_sparse_moe.gate.weight")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class ExportError(UserInputError):
    """An export cannot be written or read."""


@attrs.frozen
class TokenizerInfo:
    """What an export records of the tokenizer the model was trained with: its special ids
    (for ``config.json`` and ``generation_config.json``) and, for a Hugging Face tokenizer,
    its ``tokenizer.json`` (copied beside the weights)."""

    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    tokenizer_json: pathlib.Path | None = None
    kind: str | None = None  # "byte" or "hf"; None: unknown, no tokenizer files
    bos_token: str | None = None
    eos_token: str | None = None


def tokenizer_info(description: Mapping[str, Any]) -> TokenizerInfo:
    """The ``TokenizerInfo`` of a dataset manifest's tokenizer description (the file only
    when it is still there, with the hash the manifest recorded)."""
    path = description.get("path")
    tokenizer_json = None
    if description.get("type") == "hf" and path and pathlib.Path(path).is_file():
        data = pathlib.Path(path).read_bytes()
        if hashlib.sha256(data).hexdigest() == description.get("sha256"):
            tokenizer_json = pathlib.Path(path)
    return TokenizerInfo(
        bos_id=description.get("bos_id"),
        eos_id=description.get("eos_id"),
        pad_id=description.get("pad_id"),
        tokenizer_json=tokenizer_json,
        kind=description.get("type"),
        bos_token=description.get("bos_token"),
        eos_token=description.get("eos_token"),
    )


def write_tokenizer_files(folder: pathlib.Path, tokens: TokenizerInfo, max_len: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` so that ``AutoTokenizer`` loads the
    export: the dataset's own file for a Hugging Face tokenizer, a byte-level one with forge's
    ids for the byte tokenizer (skipped without the optional ``tokenizers`` package)."""
    if tokens.kind == "hf" and tokens.tokenizer_json is not None:
        shutil.copyfile(tokens.tokenizer_json, folder / "tokenizer.json")
        config = tokenizer_config(tokens.bos_token, tokens.eos_token, None, max_len)
    elif tokens.kind == "byte" and importlib.util.find_spec("tokenizers") is not None:
        (folder / "tokenizer.json").write_text(byte_tokenizer_json())
        config = tokenizer_config(*BYTE_SPECIAL_TOKENS, max_len)
    else:
        return
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def hf_name(name: str) -> str:
    """forge parameter name → HF Llama name."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_KEY.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ExportError(f"parameter '{name}' has no Llama equivalent")


def forge_name(name: str) -> str:
    """HF Llama name → forge parameter name."""
    for ours, theirs in _TOP.items():
        if name == theirs:
            return ours
    m = _HF_LAYER_KEY.match(name)
    if m:
        for ours, theirs in _LAYER.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
    raise ExportError(f"tensor '{name}' is not part of a Llama model forge can read")


def hf_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """forge tensor → its HF (Llama or Mixtral) tensors: one for most, one per expert for
    the experts' stacked weights; none for the router's balancing bias (always 0 under
    softmax routing, the only one exported)."""
    m = _LAYER_KEY.match(name)
    if m and m.group(2) in _EXPERTS:
        prefix = f"model.layers.{m.group(1)}.block_sparse_moe.experts"
        kind = _EXPERTS[m.group(2)]
        return {f"{prefix}.{j}.{kind}.weight": w.t() for j, w in enumerate(tensor)}
    if m and m.group(2) == _MOE_GATE[0]:
        return {f"model.layers.{m.group(1)}.{_MOE_GATE[1]}": tensor}
    if m and m.group(2) == "feed_forward.router.expert_bias":
        return {}
    return {hf_name(name): tensor}


def export_problem(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` has no Llama (or, for a mixture of experts, Mixtral) export, if it has
    none: one line naming the key."""
    if cfg.qk_norm:
        return (
            "model.qk_norm: transformers' LlamaForCausalLM has no query/key norms, so this "
            "model has no Llama export; train without qk_norm to export it"
        )
    if not cfg.moe:
        return None
    if cfg.moe_router is not MoeRouter.SOFTMAX:
        return (
            f"model.moe_router={cfg.moe_router.value!r}: MixtralForCausalLM routes by a "
            "softmax over experts, so this model has no Mixtral export"
        )
    if cfg.moe_shared_experts:
        return (
            "model.moe_shared_experts: MixtralForCausalLM has no shared experts, so this model "
            "has no Mixtral export"
        )
    if len(cfg.moe_layers) != cfg.n_layers:
        return (
            "model.moe_first_dense / model.moe_every: MixtralForCausalLM has experts in every "
            "block, so a model with dense blocks has no Mixtral export"
        )
    return None


def llama_config(cfg: ModelConfig, dtype: str, tokens: TokenizerInfo | None = None) -> dict:
    """The ``config.json`` of ``LlamaForCausalLM`` for ``cfg`` (RoPE both as transformers v5's
    ``rope_parameters`` and v4's ``rope_theta``), with the tokenizer's special ids."""
    tokens = tokens or TokenizerInfo()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "initializer_range": cfg.init_std,
        "bos_token_id": tokens.bos_id,
        "eos_token_id": tokens.eos_id,
        "pad_token_id": tokens.pad_id,
    }


def hf_config(cfg: ModelConfig, dtype: str, tokens: TokenizerInfo | None = None) -> dict:
    """``config.json``: Llama's for a dense model, Mixtral's for a mixture of experts."""
    config = llama_config(cfg, dtype, tokens)
    if not cfg.moe:
        return config
    config.pop("mlp_bias")
    return config | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": cfg.expert_hidden_dim,
        "num_local_experts": cfg.moe_num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "router_aux_loss_coef": cfg.moe_aux_loss_weight,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def generation_config(cfg: ModelConfig, tokens: TokenizerInfo) -> dict:
    """``generation_config.json``: the special ids and the context length."""
    return {
        "bos_token_id": tokens.bos_id,
        "eos_token_id": tokens.eos_id,
        "pad_token_id": tokens.pad_id,
        "max_length": cfg.max_seq_len,
    }


# --- import: what a Hugging Face folder must hold. The checks are pure functions of what was
# read (each returns its problems as lines); ``import_model`` reads, checks, then loads.

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
_JSON_LIMIT = 64 * 2**20  # config.json is kilobytes, an index of 100k tensors megabytes
_POSITIONS_LIMIT = 2**32  # RoPE tables hold a row per position: far beyond any real context
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d{1,9})\.")
_IGNORED_TENSOR = re.compile(r"\.rotary_emb\.inv_freq$")  # RoPE tables old transformers saved


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
    if given(config, "hidden_act", "silu") != "silu":
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


def export_model(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out: pathlib.Path,
    dtype: str,
    tokens: TokenizerInfo | None = None,
) -> pathlib.Path:
    """Write ``out/model.safetensors``, ``config.json``, ``generation_config.json`` and the
    tokenizer files (``write_tokenizer_files``), via a temporary folder."""
    tokens = tokens or TokenizerInfo()
    require_safetensors()
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ExportError(f"dtype '{dtype}': choose one of {sorted(DTYPES)}")
    problem = export_problem(cfg)
    if problem is not None:
        raise ExportError(problem)
    tensors = {}
    for name, tensor in state.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue  # tied: the embedding is the head
        for hf_key, value in hf_tensors(name, tensor.detach()).items():
            tensors[hf_key] = value.to(DTYPES[dtype]).contiguous().cpu()
    with staged_output(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = json.dumps(hf_config(cfg, dtype, tokens), indent=2) + "\n"
        (tmp / "config.json").write_text(config)
        generation = json.dumps(generation_config(cfg, tokens), indent=2) + "\n"
        (tmp / "generation_config.json").write_text(generation)
        write_tokenizer_files(tmp, tokens, cfg.max_seq_len)
        return replace_output(tmp, out, OutputKind.HF_EXPORT)


def require_safetensors() -> None:
    """``ExportError`` (with the command that installs it) when ``safetensors`` cannot be
    imported: exports and imports read and write nothing else."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError as exc:
        cause = " ".join(str(exc).split())
        raise ExportError(
            f"the safetensors package is not installed ({cause}); install it: "
            "pip install 'forge[safetensors]'"
        ) from exc


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
        data = path.read_bytes() if size <= _JSON_LIMIT else b""
    except OSError as exc:
        raise ExportError(f"{path}: cannot be read ({one_line(exc)})") from exc
    if size > _JSON_LIMIT:
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
    checked to be there); ``ExportError`` naming the file otherwise."""
    single, index = folder / WEIGHTS, folder / WEIGHTS_INDEX
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


def read_shapes(weights: Weights) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the files' headers (no tensor read yet)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path, names in weights.files.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = f.keys()  # a safe_open handle is not iterable
                held = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
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
        shapes |= {n: held[n] for n in (names if names is not None else held)}
    return shapes


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s Llama checkpoint with its shape (``lm_head.weight`` too,
    which a checkpoint with tied embeddings may leave out)."""
    dim, hidden, head = cfg.dim, cfg.hidden_dim, cfg.dim // cfg.n_heads
    q, kv = cfg.n_heads * head, cfg.kv_heads * head
    layer = {
        "self_attn.q_proj.weight": (q, dim),
        "self_attn.k_proj.weight": (kv, dim),
        "self_attn.v_proj.weight": (kv, dim),
        "self_attn.o_proj.weight": (dim, q),
        "mlp.gate_proj.weight": (hidden, dim),
        "mlp.up_proj.weight": (hidden, dim),
        "mlp.down_proj.weight": (dim, hidden),
        "input_layernorm.weight": (dim,),
        "post_attention_layernorm.weight": (dim,),
    }
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, dim),
        "model.norm.weight": (dim,),
        "lm_head.weight": (cfg.vocab_size, dim),
    }
    for i in range(cfg.n_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def layer_problem(n_layers: int, names: Iterable[str], weights: str) -> str | None:
    """Why the layers the tensor ``names`` hold are not ``0 .. n_layers - 1``, if they are
    not (checked before anything is listed per layer: ``n_layers`` comes from the user)."""
    held = sorted({int(m.group(1)) for n in names if (m := _LAYER_INDEX.match(n))})
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


def tensor_problems(
    expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], tied: bool
) -> list[str]:
    """Tensors ``config.json`` implies that the weights lack, tensors forge has no place for,
    and tensors of another shape (``lm_head.weight`` may be left out when ``tied``)."""
    missing = [n for n in expected if n not in found and not (tied and n == _TOP["output.weight"])]
    unknown = [n for n in found if n not in expected and not _IGNORED_TENSOR.search(n)]
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
            f"{counted(len(unknown), 'tensor')} a Llama model forge reads has no place for "
            f"({listed(unknown)}); forge's decoder has no biases or extra modules"
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
                    if not _IGNORED_TENSOR.search(name):
                        tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, TypeError, ValueError) as exc:
            raise ExportError(damaged_line(path, exc)) from exc
    return tensors


def checked(problems: Sequence[str], where: pathlib.Path | str) -> None:
    """``ExportError`` with each of ``problems`` prefixed by ``where``, if there are any."""
    if problems:
        raise ExportError([f"{where}: {p}" for p in problems])


def import_model(folder: pathlib.Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face Llama folder (``config.json`` and ``model.safetensors``, or a
    sharded checkpoint's index and shards) as forge's config and fp32 state dict.
    safetensors holds tensors only: nothing in it can run code. Everything is checked before
    a tensor is read (the config, the files, every tensor's name and shape), the values after
    (floating point, finite); each problem is an ``ExportError`` naming the file."""
    require_safetensors()
    problem = folder_problem(folder)
    if problem is not None:
        raise ExportError(problem)
    config_path = folder / CONFIG_JSON
    missing = "a Hugging Face model folder holds config.json beside its weights"
    cfg = model_config_from_llama(read_json(config_path, missing), str(config_path))
    weights = find_weights(folder)
    shapes = read_shapes(weights)
    checked(
        [p for p in (layer_problem(cfg.n_layers, shapes, weights.label.name),) if p is not None],
        config_path,
    )
    checked(tensor_problems(hf_shapes(cfg), shapes, cfg.tie_embeddings), weights.label)
    tensors = read_tensors(weights)
    checked(dtype_problems(tensors), weights.label)
    floats = {k: v.float() for k, v in tensors.items()}
    checked(finite_problems(floats), weights.label)
    head = _TOP["output.weight"]
    state = {forge_name(k): v for k, v in floats.items() if not (cfg.tie_embeddings and k == head)}
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return cfg, state
