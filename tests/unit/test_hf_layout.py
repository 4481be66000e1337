"""The pure parts of the Hugging Face families (``forge.interop.tensor_names``,
``forge.interop.families``): forge's tensor shapes by hand against a built model, Qwen3-MoE's
layout of sparse blocks both ways, the released models' ``config.json`` read as forge's
presets, plain RoPE unchanged.
``tests/integration/test_hf_families.py`` checks the families against transformers itself."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from forge.config import ModelConfig, load_config
from forge.config.latent import LatentConfig
from forge.config.model import MoeRouter
from forge.config.shapes import forge_shapes
from forge.interop.families.qwen3_moe import forge_layout, sparse_layout
from forge.interop.hf_config import hf_config_problems, model_config_from_hf
from forge.interop.tensor_names import all_shapes
from forge.metrics.flops import non_embedding_parameters
from forge.model.transformer import Transformer, num_parameters, rope_tables
from tests.conftest import REPO


def test_forge_shapes_are_the_built_models_state_dict():
    moe = ModelConfig(
        dim=32, n_layers=3, n_heads=4, moe_num_experts=4, moe_top_k=2, moe_hidden_dim=24,
        moe_shared_experts=1, moe_first_dense=1,
    )  # fmt: skip
    latent = LatentConfig(kv_rank=8, q_rank=12, nope_dim=4, rope_dim=4, v_dim=6)
    for cfg in (
        ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True),
        moe,
        ModelConfig(dim=32, n_layers=2, n_heads=2, tie_embeddings=True),
        attrs.evolve(moe, mla=latent, moe_router=MoeRouter.SIGMOID, mtp_depth=2, mtp_moe=True),
        attrs.evolve(moe, mla=attrs.evolve(latent, q_rank=0), mtp_depth=1),
    ):
        with torch.device("meta"):
            state = Transformer(cfg).state_dict()
        assert all_shapes(cfg) == {k: tuple(v.shape) for k, v in state.items()}
        assert all_shapes(cfg) == forge_shapes(cfg) or cfg.mtp_depth


def hf_sparse_blocks(n_layers: int, step: int, dense: list[int]) -> list[int]:
    """transformers' rule (Qwen3MoeDecoderLayer): which blocks are sparse."""
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


def test_every_forge_layout_exports_to_a_qwen3_moe_layout_and_back():
    """All layouts of up to 9 blocks: the export's (decoder_sparse_step, mlp_only_layers) make
    transformers sparsify forge's blocks, and the import reads forge's keys back."""
    for n in range(1, 10):
        for every in range(1, n + 1):
            for first in range(n):
                cfg = ModelConfig(n_layers=n, moe_num_experts=2, moe_every=every,
                                  moe_first_dense=first)  # fmt: skip
                if not cfg.moe_layers:
                    continue
                step, dense = sparse_layout(cfg)
                assert hf_sparse_blocks(n, step, dense) == list(cfg.moe_layers)
                every_, first_ = forge_layout(n, step, dense) or (0, 0)
                assert attrs.evolve(cfg, moe_every=every_, moe_first_dense=first_).moe_layers == (
                    cfg.moe_layers
                )


# (n_layers, decoder_sparse_step, mlp_only_layers, forge's (moe_every, moe_first_dense))
LAYOUTS = [
    (48, 1, [], (1, 0)),  # Qwen3-30B-A3B
    (6, 2, [], (2, 0)),  # blocks 1, 3, 5
    (6, 1, [0, 1], (1, 2)),  # the first two dense
    (6, 1, [0, 9, 2, 4], (2, 0)),  # the even blocks dense (9 is past the last block)
    (6, 1, [3], None),  # a dense block between sparse ones
    (6, 2, [3], None),  # block 1 sparse, 3 dense, 5 sparse
    (10**15, 1, [], (1, 0)),  # a huge count (from the file) is never enumerated
    (10**15, 1, [5], None),
]


@pytest.mark.parametrize(("n", "step", "dense", "layout"), LAYOUTS)
def test_forge_layout_of_qwen3_moe_keys(n, step, dense, layout):
    assert forge_layout(n, step, dense) == layout
    if layout is not None and n < 100:
        cfg = ModelConfig(n_layers=n, moe_num_experts=2, moe_every=layout[0],
                          moe_first_dense=layout[1])  # fmt: skip
        assert list(cfg.moe_layers) == hf_sparse_blocks(n, step, dense)


# the released models' config.json keys forge reads (their model cards' files, v4 spelling:
# rope_scaling and a top-level rope_theta); the preset is that model, but for the RoPE table's
# length where the release's context is longer than the preset trains at
RELEASED = {
    "llama3_1b": {  # meta-llama/Llama-3.2-1B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "initializer_range": 0.02,
    },
    "qwen3_0_6b": {  # Qwen/Qwen3-0.6B
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
        "initializer_range": 0.02,
    },
}  # fmt: skip


def preset(name: str) -> ModelConfig:
    return load_config([str(REPO / "configs" / "train" / f"{name}.toml")]).config.model


@pytest.mark.parametrize("name", list(RELEASED))
def test_a_released_config_json_imports_as_its_preset(name):
    cfg, _ = model_config_from_hf(RELEASED[name])
    assert cfg == attrs.evolve(preset(name), max_seq_len=cfg.max_seq_len)


# deepseek-ai/DeepSeek-V3's config.json (the keys forge reads and DeepSeek's own; its
# auto_map left out), as released: FP8 weights, YaRN to a 163840-token context
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_deepseek_v3s_config_json_is_refused_for_its_yarn_and_without_it_is_the_preset():
    """The release's YaRN is refused by name; without it the file is the preset's model but
    for what config.json does not say: the depths (an import reads them off the weights),
    the training keys, and the preset's pre-training context."""
    assert hf_config_problems(DEEPSEEK_V3) == [
        "config.json: RoPE type 'yarn' (rope scaling) is not implemented by forge, only plain "
        "RoPE ('default') and Llama 3.1's ('llama3'); the model's logits would differ"
    ]
    ours = preset("deepseek_v3_671b")
    plain = {k: v for k, v in DEEPSEEK_V3.items() if k != "rope_scaling"}
    cfg, _ = model_config_from_hf(plain)
    keys = ("max_seq_len", "mtp_depth", "mtp_moe", "moe_bias_update_rate", "moe_aux_loss_weight")
    assert attrs.evolve(cfg, **{k: getattr(ours, k) for k in keys}) == ours
    assert (cfg.mtp_depth, ours.mtp_depth, ours.mtp_moe) == (0, 1, True)


def test_the_deepseek_v3_preset_has_the_releases_counts_and_transformers_builds_it():
    """671.03B in the model (DeepSeek's 671B), 37.55B active (its 37B), 11.61B in the depth
    (its 14B holds its own copies of the embedding and head: 684.5B in the files), and
    transformers' own class, from the config.json forge's export writes, has the model's
    parameters exactly (it builds no depth)."""
    transformers = pytest.importorskip("transformers")
    from forge.interop.export import hf_config

    cfg = preset("deepseek_v3_671b")
    with torch.device("meta"):
        model = Transformer(cfg)
    total, embedding = num_parameters(model), cfg.vocab_size * cfg.dim
    depth = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert (total - depth, depth) == (671_026_404_352, 11_610_067_968)
    assert non_embedding_parameters(cfg, active=True) + embedding == 37_552_282_624
    files = sum(math.prod(s) for n, s in all_shapes(cfg).items() if "expert_bias" not in n)
    assert files + 2 * embedding == 684_489_830_400  # with the depth's copies, no buffers
    config = hf_config(cfg, "bfloat16")
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf)
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    assert sum(p.numel() for p in theirs.parameters()) == total - depth


def test_rope_tables_without_scaling_are_unchanged():
    cos, sin = rope_tables(16, 8, 10000.0)
    angles = torch.outer(torch.arange(8.0), 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16.0))
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())


@pytest.mark.parametrize("name", ["deepseek_v3_debug", "deepseek_v3_671b"])
def test_the_deepseek_v3_presets_export_as_deepseek_v3(name):
    from forge.interop.export_rules import export_family, export_problem

    cfg = preset(name)
    assert export_problem(cfg) is None and export_family(cfg).architecture == (
        "DeepseekV3ForCausalLM"
    )
    assert cfg.mla is not None and cfg.mtp_depth == 1 and cfg.mtp_moe


MOE_NO_LATENT = ModelConfig(dim=32, n_layers=2, n_heads=4, moe_num_experts=4, moe_top_k=2)

# (case, the model, the keys its export's caveats name)
CAVEATS = [
    ("DeepSeek-V3 as released", preset("deepseek_v3_debug"), []),
    ("dense depths", attrs.evolve(preset("deepseek_v3_debug"), mtp_moe=False), ["model.mtp_moe"]),
    (
        "a capacity factor and dense depths",
        attrs.evolve(preset("deepseek_v3_debug"), mtp_moe=False, moe_capacity_factor=1.25),
        ["model.moe_capacity_factor", "model.mtp_moe"],
    ),
    ("Mixtral, dropless", MOE_NO_LATENT, []),
    (
        "Mixtral with a capacity factor",
        attrs.evolve(MOE_NO_LATENT, moe_capacity_factor=1.0),
        ["model.moe_capacity_factor"],
    ),
    # no export at all: its refusal is what is said, not a caveat
    ("no export", attrs.evolve(MOE_NO_LATENT, moe_capacity_factor=1.0, sliding_window=8), []),
]


@pytest.mark.parametrize("cfg,keys", [c[1:] for c in CAVEATS], ids=[c[0] for c in CAVEATS])
def test_an_export_that_computes_or_reads_otherwise_names_the_key_that_makes_it(cfg, keys):
    from forge.interop.export_rules import export_caveats

    assert [line.split("=")[0] for line in export_caveats(cfg)] == keys
