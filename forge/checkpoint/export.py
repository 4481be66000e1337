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
import pathlib
import re
import shutil
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from forge.checkpoint.hf_tokenizer import BYTE_SPECIAL_TOKENS, byte_tokenizer_json, tokenizer_config
from forge.config.sections import ModelConfig, MoeRouter
from forge.errors import UserInputError
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
TOP_TENSORS = {
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
    if name in TOP_TENSORS:
        return TOP_TENSORS[name]
    m = _LAYER_KEY.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ExportError(f"parameter '{name}' has no Llama equivalent")


def forge_name(name: str) -> str:
    """HF Llama name → forge parameter name."""
    for ours, theirs in TOP_TENSORS.items():
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
    if cfg.sliding_window:
        return (
            f"model.sliding_window={cfg.sliding_window}: LlamaForCausalLM attends to the whole "
            "context, so this model has no Llama export; train without a window to export it"
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
