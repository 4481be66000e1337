"""Model-only export in Hugging Face layout: ``model.safetensors`` plus ``config.json``.

The export is a rename and a dtype cast into the family ``export_rules.export_family`` picks
(each family's rule is its spec's, ``forge.interop.families``): ``LlamaForCausalLM`` for a
dense model, ``Qwen3ForCausalLM`` for one with ``model.qk_norm``, and for a mixture of experts
with softmax top-k routing (renormalised, no shared experts) ``MixtralForCausalLM`` (experts
in every block) or ``Qwen3MoeForCausalLM`` (with ``model.qk_norm``; dense blocks where forge
has them), one tensor per expert (the layout transformers v4 reads and v5 converts); with
latent attention, ``DeepseekV3ForCausalLM`` (sigmoid routing, shared experts, the multi-token
depths in DeepSeek's naming). Every family loads back into forge (``hf_import``). Needs the
optional ``safetensors`` package (``pip install 'forge[safetensors]'``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from forge.config.checkpoint import ExportDtype
from forge.config.sections import ModelConfig
from forge.config.shapes import ROUTER_BIAS
from forge.interop.export_rules import export_family, export_problem
from forge.interop.families import FAMILIES
from forge.interop.family import FamilySpec
from forge.interop.hf_tokenizer import BYTE_SPECIAL_TOKENS, byte_tokenizer_json, tokenizer_config
from forge.interop.tensor_names import ExportError, hf_names, is_expert_weight
from forge.outputs import OutputKind, replace_output, staged_output

# the dtypes an export writes: checkpoint.export_dtype's, and convert_checkpoint.py's --dtype
DTYPES = {d.value: getattr(torch, d.value) for d in ExportDtype}


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


def hf_tensors(
    name: str, tensor: torch.Tensor, cfg: ModelConfig, families: Sequence[FamilySpec] = FAMILIES
) -> dict[str, torch.Tensor]:
    """forge tensor → its HF tensors in ``cfg``'s export family (``hf_names``): the stacked
    experts' ``(E, in, out)`` weight as one ``(out, in)`` Linear weight per expert, channels in
    the family's order (its ``reorder``, inverted), a copy a depth's layer holds as a tensor
    of its own (safetensors writes no two names over one memory)."""
    family = export_family(cfg, families)
    names = hf_names(name, family, cfg)
    if is_expert_weight(name):
        return {hf: w.t() for hf, w in zip(names, tensor, strict=True)}
    order = family.reorder(name, cfg, family.export_keys(cfg))
    if order is not None:
        axis, index = order
        inverse = torch.empty(len(index), dtype=torch.long)
        inverse[torch.tensor(index)] = torch.arange(len(index))
        tensor = tensor.index_select(axis, inverse.to(tensor.device))
    return {hf: tensor if i == 0 else tensor.clone() for i, hf in enumerate(names)}


def rope_config(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE's keys: transformers v5's ``rope_parameters`` and v4's ``rope_theta`` (and
    ``rope_scaling`` under ``model.rope_scaling``), the same values in both."""
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    config: dict[str, Any] = {"rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        scaling = {
            "rope_type": cfg.rope_scaling.type.value,
            "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_seq_len,
        }
        params |= scaling
        config["rope_scaling"] = scaling
    return config | {"rope_parameters": params}


def llama_config(cfg: ModelConfig, dtype: str, tokens: TokenizerInfo | None = None) -> dict:
    """The ``config.json`` of ``LlamaForCausalLM`` for ``cfg`` (``rope_config``'s RoPE),
    with the tokenizer's special ids."""
    tokens = tokens or TokenizerInfo()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        **rope_config(cfg),
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


def hf_config(
    cfg: ModelConfig,
    dtype: str,
    tokens: TokenizerInfo | None = None,
    families: Sequence[FamilySpec] = FAMILIES,
) -> dict:
    """``config.json`` of ``cfg``'s export family: Llama's keys, the family's own over them
    and after them (its spec's ``export_keys``: Mixtral's experts, Qwen3's windowless
    attention, Qwen3-MoE's both and its layout of sparse blocks)."""
    config = llama_config(cfg, dtype, tokens)
    family = export_family(cfg, families)
    config.pop("mlp_bias")  # Llama's key alone: its spec writes it back
    config |= {"architectures": [family.architecture], "model_type": family.model_type}
    return config | family.export_keys(cfg)


def generation_config(cfg: ModelConfig, tokens: TokenizerInfo) -> dict:
    """``generation_config.json``: the special ids and the context length."""
    return {
        "bos_token_id": tokens.bos_id,
        "eos_token_id": tokens.eos_id,
        "pad_token_id": tokens.pad_id,
        "max_length": cfg.max_seq_len,
    }


def export_model(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out: pathlib.Path,
    dtype: str,
    tokens: TokenizerInfo | None = None,
    families: Sequence[FamilySpec] = FAMILIES,
) -> pathlib.Path:
    """Write ``out/model.safetensors``, ``config.json``, ``generation_config.json`` and the
    tokenizer files (``write_tokenizer_files``), via a temporary folder, as ``cfg``'s family
    of ``families``."""
    tokens = tokens or TokenizerInfo()
    require_safetensors()
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ExportError(f"dtype '{dtype}': choose one of {sorted(DTYPES)}")
    problem = export_problem(cfg, families)
    if problem is not None:
        raise ExportError(problem)
    tensors = {}
    for name, tensor in state.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue  # tied: the embedding is the head
        # the balancing bias moves in steps of ~1e-3: fp32 in forge's model and in the file
        cast = torch.float32 if name.endswith(ROUTER_BIAS) else DTYPES[dtype]
        for hf_key, value in hf_tensors(name, tensor.detach(), cfg, families).items():
            tensors[hf_key] = value.to(cast).contiguous().cpu()
    for hf_key, shape in export_family(cfg, families).placeholders(cfg).items():
        tensors[hf_key] = torch.zeros(shape, dtype=DTYPES[dtype])  # what its class holds
    with staged_output(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = json.dumps(hf_config(cfg, dtype, tokens, families), indent=2) + "\n"
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
