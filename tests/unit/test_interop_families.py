"""A Hugging Face family is one ``FamilySpec`` and its place in a registry (docs/interop.md,
"Adding a model family"): families added here through a spec alone, passed to the export and
the import as their registry, round-trip a tiny model (the same config, the same tensors), and
the registry decides which families a folder may be. No transformers: the classes named here
do not exist; ``tests/integration/test_hf_families.py`` checks the real ones against it."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import torch

from forge.config import ModelConfig
from forge.config.latent import LatentConfig
from forge.config.model import MoeRouter
from forge.interop.export import ExportError, export_model
from forge.interop.export_rules import export_family, export_problem
from forge.interop.families import DEEPSEEK_V3, FAMILIES, LLAMA
from forge.interop.family import FamilySpec, HfConfig, router_keys
from forge.interop.hf_import import import_model
from forge.interop.hf_json import given
from forge.model.transformer import Transformer

pytest.importorskip("safetensors")

# a Llama under another name: everything but its identity is Llama's
LLAMA_LIKE = attrs.evolve(
    LLAMA, model_type="llama_like", architecture="LlamaLikeForCausalLM", label="Llama-like"
)


def tiny_moe_import_keys(config: HfConfig) -> dict[str, Any]:
    return {
        "moe_num_experts": config["num_experts"],
        "moe_top_k": given(config, "experts_per_token", 2),
        "moe_hidden_dim": config["expert_size"],
        "moe_every": config["moe_step"],
        "moe_first_dense": config["dense_blocks"],
    }


def tiny_moe_export_keys(cfg: ModelConfig) -> dict[str, Any]:
    return router_keys(cfg) | {
        "num_experts": cfg.moe_num_experts,
        "experts_per_token": cfg.moe_top_k,
        "expert_size": cfg.expert_hidden_dim,
        "moe_step": cfg.moe_every,
        "dense_blocks": cfg.moe_first_dense,
    }


def tiny_moe_refusal(config: HfConfig) -> str | None:
    return "shared_experts: TinyMoe's are not forge's" if config.get("shared_experts") else None


# a mixture of experts with names of its own: its block, its experts, its keys, its refusal
TINY_MOE = FamilySpec(
    model_type="tiny_moe",
    architecture="TinyMoeForCausalLM",
    label="TinyMoe",
    exports=lambda cfg: cfg.moe and not cfg.qk_norm,
    defaults={"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64},
    moe=True,
    ints=("num_experts", "experts_per_token", "expert_size", "moe_step", "dense_blocks"),
    moe_block="moe",
    expert_names={"w1": "gate", "w2": "down", "w3": "up"},
    import_keys=tiny_moe_import_keys,
    export_keys=tiny_moe_export_keys,
    import_refusal=tiny_moe_refusal,
)
REGISTRY = (LLAMA_LIKE, TINY_MOE, *FAMILIES)  # the first family whose rule holds exports

# every key an import reads stated, so that the config round-trips as it is
DENSE = ModelConfig(
    dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64, max_seq_len=16
)
MOE = attrs.evolve(
    DENSE, moe_num_experts=3, moe_top_k=2, moe_hidden_dim=24, moe_every=2, moe_first_dense=1
)


def exported(cfg: ModelConfig, tmp_path) -> tuple[dict[str, torch.Tensor], Any]:
    torch.manual_seed(0)
    state = Transformer(cfg).state_dict()
    export_model(state, cfg, tmp_path / "exp", "float32", families=REGISTRY)
    return state, tmp_path / "exp"


@pytest.mark.parametrize(
    ("cfg", "family"), [(DENSE, LLAMA_LIKE), (MOE, TINY_MOE)], ids=["llama-like", "tiny-moe"]
)
def test_a_family_added_by_its_spec_alone_round_trips_a_model(cfg, family, tmp_path):
    assert export_family(cfg, REGISTRY) is family
    state, folder = exported(cfg, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == family.model_type
    assert config["architectures"] == [family.architecture]
    back, tensors = import_model(folder, families=REGISTRY)
    assert back == cfg
    assert tensors.keys() == state.keys()
    assert all(torch.equal(tensors[k], v) for k, v in state.items())


def test_the_spec_names_the_tensors(tmp_path):
    from safetensors import safe_open

    _, folder = exported(MOE, tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.2.moe.experts.2.gate.weight" in names
    assert "model.layers.2.moe.gate.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # a dense block: every family's names


def test_the_registry_decides_what_a_folder_may_be(tmp_path):
    _, folder = exported(DENSE, tmp_path)
    with pytest.raises(ExportError) as info:
        import_model(folder)  # forge's own registry lacks the family
    assert info.value.lines == [
        f"{folder / 'config.json'}: model_type 'llama_like': forge imports DeepSeek-V3, Llama, "
        "Mixtral, Qwen3 and Qwen3-MoE models (model_type 'deepseek_v3', 'llama', 'mixtral', "
        "'qwen3', 'qwen3_moe') only; another model's weights do not fit forge's decoder"
    ]
    assert export_family(DENSE) is LLAMA  # and its own export is Llama's


def test_a_spec_refuses_what_it_says(tmp_path):
    _, folder = exported(MOE, tmp_path)
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"shared_experts": True}))
    with pytest.raises(ExportError) as info:
        import_model(folder, families=REGISTRY)
    assert info.value.lines == [f"{path}: shared_experts: TinyMoe's are not forge's"]


def test_a_model_no_family_of_the_registry_holds_has_no_export():
    line = (
        "this model has no export: it is none of the Llama-like models (model_type "
        "'llama_like') forge exports"
    )
    assert export_problem(MOE, (LLAMA_LIKE,)) == line
    with pytest.raises(ExportError, match="has no export"):
        export_family(MOE, (LLAMA_LIKE,))


def reversed_latent(
    name: str, cfg: ModelConfig, config: HfConfig
) -> tuple[int, tuple[int, ...]] | None:
    """A family storing the latent projection's rows in reverse."""
    if cfg.mla is None or not name.endswith("attention.wkv_a.weight"):
        return None
    return 0, tuple(reversed(range(cfg.mla.kv_rank + cfg.mla.rope_dim)))


# DeepSeek-V3's spec under another name, with depths named otherwise, no copies of the
# embedding and head in them, and channels of its own order: all of it spec fields
TINY_MLA = attrs.evolve(
    DEEPSEEK_V3,
    model_type="tiny_mla",
    architecture="TinyMlaForCausalLM",
    label="TinyMLA",
    mtp_names={
        "hidden_norm.weight": "h_norm.weight",
        "embed_norm.weight": "e_norm.weight",
        "proj.weight": "join.weight",
        "norm.weight": "out_norm.weight",
    },
    mtp_copies={},
    reorder=reversed_latent,
)
MLA = attrs.evolve(
    MOE,
    n_kv_heads=None,  # latent attention has none: an import reads it unset
    norm_eps=1e-6,
    moe_every=1,
    moe_router=MoeRouter.SIGMOID,
    mla=LatentConfig(kv_rank=8, q_rank=0, nope_dim=4, rope_dim=4, v_dim=6),
    mtp_depth=2,
    mtp_moe=True,
)


def test_depths_and_channel_orders_are_spec_fields(tmp_path):
    from safetensors.torch import load_file

    registry = (TINY_MLA, *FAMILIES)
    assert export_family(MLA, registry) is TINY_MLA
    torch.manual_seed(0)
    state = Transformer(MLA).state_dict()
    export_model(state, MLA, tmp_path / "exp", "float32", families=registry)
    written = load_file(str(tmp_path / "exp" / "model.safetensors"))
    assert "model.layers.4.join.weight" in written  # depth 2: after the 3 blocks and depth 1
    assert not any("embed_tokens" in k for k in written if k.startswith("model.layers."))
    latent = written["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(latent, state["layers.0.attention.wkv_a.weight"].flip(0))
    back, tensors = import_model(tmp_path / "exp", families=registry)
    assert back == MLA
    assert tensors.keys() == state.keys()
    assert all(torch.equal(tensors[k], v) for k, v in state.items())
