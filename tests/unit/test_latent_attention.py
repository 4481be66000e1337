"""Multi-head latent attention (``[model.mla]``): the layer against DeepSeek-V2's equations
written out head by head, packed documents and a sliding window as their masks say, cached
decoding equal to the full forward, a KV cache smaller than GQA's, the counts, and the
refusals by key."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from forge.config.latent import LatentConfig
from forge.config.model import ModelConfig
from forge.config.shapes import forge_shapes
from forge.metrics.flops import flops_per_token
from forge.model.generate import sample
from forge.model.latent_attention import LatentAttention
from forge.model.layers import apply_rope
from forge.model.transformer import KVCache, Transformer, model_rope_tables, num_parameters

MLA = LatentConfig(kv_rank=16, q_rank=8, nope_dim=8, rope_dim=4, v_dim=6)
CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, mla=MLA)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference(layer: LatentAttention, x: torch.Tensor, cos, sin, allowed) -> torch.Tensor:
    """DeepSeek-V2's latent attention, head by head, over the ``allowed`` (T, T) pairs."""
    m, eps = MLA, CFG.norm_eps
    t = x.shape[1]
    c_q = rms(x @ layer.wq_a.weight.T, layer.q_a_norm.weight, eps)  # type: ignore[union-attr]
    q = (c_q @ layer.wq_b.weight.T).view(1, t, CFG.n_heads, m.qk_dim)  # type: ignore[union-attr]
    kv_a = x @ layer.wkv_a.weight.T
    c_kv = rms(kv_a[..., : m.kv_rank], layer.kv_norm.weight, eps)
    k_rope = apply_rope(kv_a[..., m.kv_rank :][:, None], cos, sin)[:, 0]  # (1, T, rope)
    kv = (c_kv @ layer.wkv_b.weight.T).view(1, t, CFG.n_heads, m.nope_dim + m.v_dim)
    heads = []
    for h in range(CFG.n_heads):
        q_h = q[0, :, h]
        q_h = torch.cat(
            [q_h[:, : m.nope_dim], apply_rope(q_h[None, None, :, m.nope_dim :], cos, sin)[0, 0]],
            dim=-1,
        )
        k_h = torch.cat([kv[0, :, h, : m.nope_dim], k_rope[0]], dim=-1)
        v_h = kv[0, :, h, m.nope_dim :]
        scores = (q_h @ k_h.T) / math.sqrt(m.qk_dim)
        scores = scores.masked_fill(~allowed, float("-inf"))
        heads.append(scores.softmax(-1) @ v_h)
    return torch.cat(heads, dim=-1)[None] @ layer.wo.weight.T


def layer_and_input(cfg: ModelConfig = CFG, t: int = 12):
    torch.manual_seed(0)
    model = Transformer(cfg)
    layer = model.layers["0"].attention
    assert isinstance(layer, LatentAttention)
    x = torch.randn(1, t, cfg.dim)
    cos, sin = model_rope_tables(cfg)
    return model, layer, x, cos[:t], sin[:t]


def test_the_layer_is_deepseeks_equations():
    _, layer, x, cos, sin = layer_and_input()
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    with torch.no_grad():
        torch.testing.assert_close(layer(x, cos, sin), reference(layer, x, cos, sin, causal))


def test_a_sliding_window_sees_its_last_keys_only():
    cfg = attrs.evolve(CFG, sliding_window=3)
    model, layer, x, cos, sin = layer_and_input(cfg)
    i = torch.arange(12)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
    mask = model.attention_mask(x.device, (1, 12), None, None)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, cos, sin, mask), reference(layer, x, cos, sin, band))


def test_packed_documents_attend_within_themselves():
    torch.manual_seed(0)
    model = Transformer(CFG)
    tokens = torch.randint(0, 64, (1, 12))
    documents = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.tensor([list(range(5)) + list(range(7))])
    with torch.no_grad():
        packed = model(tokens, positions=positions, document_ids=documents)
        first, second = model(tokens[:, :5]), model(tokens[:, 5:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_rank", [0, 8], ids=["full queries", "query bottleneck"])
def test_cached_decoding_equals_the_full_forward(q_rank):
    cfg = attrs.evolve(CFG, mla=attrs.evolve(MLA, q_rank=q_rank))
    torch.manual_seed(0)
    model = Transformer(cfg)
    x = torch.randint(0, 64, (2, 20))
    cache = KVCache(cfg, batch=2)
    with torch.no_grad():
        steps = [
            model(x[:, :9], cache=cache),
            model(x[:, 9:10], cache=cache),
            model(x[:, 10:], cache=cache),
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), model(x), rtol=1e-5, atol=1e-5)
    assert sample(model, [1, 2, 3], 12, temperature=0) == sample(
        model, [1, 2, 3], 12, temperature=0, use_cache=False
    )


def test_the_cache_keeps_the_latent_and_the_rotated_key_only():
    """DeepSeek-V3's shapes against GQA with as many heads of its width: (512 + 64) values a
    token and layer against 2 × kv_heads × 128."""
    mla = LatentConfig(kv_rank=512, q_rank=0, nope_dim=128, rope_dim=64, v_dim=128)
    big = ModelConfig(dim=1024, n_layers=1, n_heads=8, max_seq_len=64, mla=mla)
    gqa = ModelConfig(dim=1024, n_layers=1, n_heads=8, n_kv_heads=8, max_seq_len=64)
    latent, grouped = KVCache(big), KVCache(gqa)
    per_token = latent.keys.numel() + latent.values.numel()
    assert per_token / 64 == 576
    assert (grouped.keys.numel() + grouped.values.numel()) / 64 == 2 * 8 * 128


def test_counts_follow_the_layer():
    """The built model's parameters are the shapes' (which the memory plan and the FLOPs
    read); the attention term counts each head's query-key and value widths."""
    model, *_ = layer_and_input()
    shapes = forge_shapes(CFG)
    assert num_parameters(model) == sum(math.prod(s) for s in shapes.values())
    multiplied = sum(math.prod(s) for n, s in shapes.items() if n != "tok_embeddings.weight")
    scores = CFG.n_layers * CFG.n_heads * (MLA.qk_dim + MLA.v_dim) * 32
    assert flops_per_token(CFG, 32) == pytest.approx(6.0 * multiplied + 6.0 * scores)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model.mla.rope_dim=3"], "model.mla.rope_dim: must be even"),
        (["--model.mla.kv_rank=0"], "model.mla.kv_rank: must be > 0"),
        (["--model.qk_norm=true"], "model.qk_norm: latent attention"),
        (["--model.attention=varlen"], "model.attention: 'varlen' is not supported with"),
        # measured: the same parameters and losses bit for bit with or without them
        (["--model.n_kv_heads=2"], "model.n_kv_heads: has no effect with [model.mla]"),
        (["--model.head_dim=32"], "model.head_dim: has no effect with [model.mla]"),
    ],
)
def test_bad_latent_keys_are_refused_by_name(tmp_path, args, fragment):
    from forge.config import load_config
    from forge.config.loader import ConfigError

    path = tmp_path / "c.toml"
    path.write_text(
        '[model]\ndim = 32\nn_heads = 4\n[model.mla]\nkv_rank = 16\n[data]\npath = "x"\n'
    )
    with pytest.raises(ConfigError) as err:
        load_config([str(path), *args])
    assert fragment in str(err.value)


LATENT_KEYS, MTP_KEYS = "[model.mla]\nkv_rank = 16\n", "mtp_depth = 1\n"


@pytest.mark.parametrize(
    ("feature", "what", "dim", "refused"),
    [
        (LATENT_KEYS, "latent attention", "tp", False),
        (LATENT_KEYS, "latent attention", "pp", False),
        (LATENT_KEYS, "latent attention", "cp", True),
        (MTP_KEYS, "multi-token", "tp", False),
        (MTP_KEYS, "multi-token", "pp", False),
        (MTP_KEYS, "multi-token", "cp", False),
    ],
)
def test_model_parallel_layouts_without_a_plan_are_refused_by_name(
    tmp_path, feature, what, dim, refused
):
    from forge.config import load_config
    from forge.parallel.world import parallel_problems

    path = tmp_path / "c.toml"
    model = "[model]\ndim = 32\nn_heads = 4\nn_layers = 2\n"
    model += feature if feature.startswith("mtp") else ""
    text = model + (feature if feature.startswith("[") else "") + '[data]\npath = "x"\n'
    path.write_text(text + "[train]\ngrad_accum_steps = 2\nseq_len = 32\n")
    config = load_config([str(path), f"--distributed.{dim}=2", "--distributed.dp_shard=1"]).config
    lines = [f"{k}: {m}" for k, m in parallel_problems(config, 2)]
    named = [line for line in lines if line.startswith(f"distributed.{dim}: is not supported")]
    assert [what in line for line in named] == ([True] if refused else []), lines
