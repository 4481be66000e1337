"""FLOPs per token, the peak table and the throughput record, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from forge.config.sections import ModelConfig, Precision
from forge.metrics.flops import (
    flops_per_token,
    non_embedding_parameters,
    table_peak_flops,
    throughput_record,
)
from forge.model.transformer import Transformer, num_parameters

TINY = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, ffn_hidden_dim=96, max_seq_len=32
)
LLAMA3_8B = ModelConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    ffn_hidden_dim=14336,
    max_seq_len=8192,
)

# (config, seq_len, non-embedding parameters, FLOPs per token), worked by hand:
#   tiny: attention 2·32·32 + 2·32·16 = 3072, FFN 3·32·96 = 9216, norms 64 -> 12352 per block;
#         2 blocks + final norm 32 + head 259·32 = 33024; 6·33024 + 12·2·32·32 = 222720
#   Llama-3 8B: attention 2·4096² + 2·4096·1024 = 41943040, FFN 3·4096·14336 = 176160768,
#         norms 8192 -> 218112000 per block; ·32 + 4096 + 128256·4096 = 7504924672
#         (+ the 525336576 embedding = 8.03B, the model card's count);
#         6·7504924672 + 12·32·4096·8192 = 57914449920
FLOP_CASES = [
    (TINY, 32, 33_024, 222_720),
    (LLAMA3_8B, 8192, 7_504_924_672, 57_914_449_920),
]


@pytest.mark.parametrize(("cfg", "seq_len", "params", "flops"), FLOP_CASES, ids=["tiny", "8b"])
def test_flops_per_token_equal_hand_computed_values(cfg, seq_len, params, flops):
    assert non_embedding_parameters(cfg) == params
    assert flops_per_token(cfg, seq_len) == flops


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_non_embedding_parameters_count_the_built_model_without_its_embedding(tied, qk_norm):
    """Tied: the one matrix is the head a token passes through, counted once."""
    import attrs

    cfg = attrs.evolve(TINY, tie_embeddings=tied, qk_norm=qk_norm)
    with torch.device("meta"):
        model = Transformer(cfg)
    embedding = 0 if tied else cfg.vocab_size * cfg.dim
    assert non_embedding_parameters(cfg) == num_parameters(model) - embedding


PEAK_CASES = [
    ("NVIDIA H100 80GB HBM3", Precision.BF16, 989e12),
    ("NVIDIA H100 PCIe", Precision.BF16, 756e12),  # not shadowed by "H100"
    ("NVIDIA H100 NVL", Precision.FP32, 60e12),
    ("NVIDIA H200", Precision.BF16, 989e12),
    ("NVIDIA GH200 480GB", Precision.BF16, 989e12),
    ("NVIDIA A100-SXM4-80GB", Precision.FP32, 19.5e12),
    ("NVIDIA B200", Precision.BF16, 2250e12),
    ("AMD Instinct MI300X", Precision.BF16, 1307.4e12),
    ("Tesla T4", Precision.BF16, None),  # unknown: no MFU rather than a wrong one
]


@pytest.mark.parametrize(("name", "dtype", "peak"), PEAK_CASES)
def test_peak_flops_by_device_name_and_dtype(name, dtype, peak):
    assert table_peak_flops(name, dtype) == peak


def test_throughput_record_is_per_device():
    record = throughput_record(8000.0, 4, 1e9, peak=1e12)
    assert record == {"tokens_per_sec_per_device": 2000.0, "tflops": 2.0, "mfu": 2.0}
    assert "mfu" not in throughput_record(8000.0, 4, 1e9, peak=None)
