"""The pure parts of the Hugging Face families (``forge.interop.tensor_names``,
``forge.interop.families``): forge's tensor shapes by hand against a built model, Qwen3-MoE's
layout of sparse blocks both ways, the released models' ``config.json`` read as forge's
presets, plain RoPE unchanged.
``tests/integration/test_hf_families.py`` checks the families against transformers itself."""

from __future__ import annotations

import attrs
import pytest
import torch

from forge.config import ModelConfig, load_config
from forge.config.shapes import forge_shapes
from forge.interop.families.qwen3_moe import forge_layout, sparse_layout
from forge.interop.hf_config import model_config_from_hf
from forge.model.transformer import Transformer, rope_tables
from tests.conftest import REPO


def test_forge_shapes_are_the_built_models_state_dict():
    moe = {"moe_num_experts": 3, "moe_top_k": 2, "moe_hidden_dim": 24, "moe_shared_experts": 1}
    for cfg in (
        ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True),
        ModelConfig(dim=32, n_layers=3, n_heads=4, moe_first_dense=1, **moe),
        ModelConfig(dim=32, n_layers=2, n_heads=2, tie_embeddings=True),
    ):
        with torch.device("meta"):
            state = Transformer(cfg).state_dict()
        assert forge_shapes(cfg) == {k: tuple(v.shape) for k, v in state.items()}


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


@pytest.mark.parametrize("name", list(RELEASED))
def test_a_released_config_json_imports_as_its_preset(name):
    cfg, _ = model_config_from_hf(RELEASED[name])
    ours = load_config([str(REPO / "configs" / "train" / f"{name}.toml")]).config.model
    assert cfg == attrs.evolve(ours, max_seq_len=cfg.max_seq_len)


def test_rope_tables_without_scaling_are_unchanged():
    cos, sin = rope_tables(16, 8, 10000.0)
    angles = torch.outer(torch.arange(8.0), 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16.0))
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
