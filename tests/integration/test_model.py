"""The decoder: shapes, causality, GQA, tied embeddings, init, stable names."""

import math

import attrs
import pytest
import torch

from forge.config import ModelConfig
from forge.model.generate import sample
from forge.model.transformer import Transformer, apply_rope, num_parameters, rope_tables

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(attrs.evolve(CFG, **kw))


def test_logits_shape():
    x = torch.randint(0, 259, (3, 16))
    assert model()(x).shape == (3, 16, 259)


def test_future_tokens_do_not_change_past_logits():
    m = model()
    x = torch.randint(0, 259, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 259
    torch.testing.assert_close(m(x)[0, :10], m(y)[0, :10])
    assert not torch.allclose(m(x)[0, 10:], m(y)[0, 10:])


def test_gqa_matches_repeated_kv_heads():
    """Grouped-query attention equals full attention whose k/v heads are repeated."""
    gqa = model()
    full = model(n_kv_heads=4)
    with torch.no_grad():
        for g, f in zip(gqa.layers.values(), full.layers.values(), strict=True):
            hd = 8
            wk = g.attention.wk.weight.view(2, hd, 32).repeat_interleave(2, 0).reshape(32, 32)
            wv = g.attention.wv.weight.view(2, hd, 32).repeat_interleave(2, 0).reshape(32, 32)
            f.attention.wk.weight.copy_(wk)
            f.attention.wv.weight.copy_(wv)
            for name in ("wq", "wo"):
                getattr(f.attention, name).weight.copy_(getattr(g.attention, name).weight)
            f.feed_forward.load_state_dict(g.feed_forward.state_dict())
        full.tok_embeddings.load_state_dict(gqa.tok_embeddings.state_dict())
        full.output.load_state_dict(gqa.output.state_dict())
    x = torch.randint(0, 259, (2, 16))
    torch.testing.assert_close(gqa(x), full(x))


def test_rope_is_a_rotation_that_depends_on_relative_position():
    cos, sin = rope_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 1, 8)
    k = torch.randn(1, 1, 1, 8)

    def dot(i, j):
        qi = apply_rope(q.expand(1, 1, 16, 8), cos, sin)[0, 0, i]
        kj = apply_rope(k.expand(1, 1, 16, 8), cos, sin)[0, 0, j]
        return float(qi @ kj)

    assert dot(3, 1) == pytest.approx(dot(7, 5), abs=1e-5)
    rotated = apply_rope(q.expand(1, 1, 16, 8), cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1).expand(1, 1, 16))


def test_tied_embeddings_share_one_tensor():
    m = model(tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    assert num_parameters(m) == num_parameters(model()) - 259 * 32


def test_residual_projections_get_scaled_init():
    m = Transformer(ModelConfig(dim=256, n_layers=8, n_heads=4))
    wq = m.layers["0"].attention.wq.weight.std().item()
    wo = m.layers["0"].attention.wo.weight.std().item()
    assert wq == pytest.approx(0.02, rel=0.05)
    assert wo == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_parameter_names_are_stable():
    names = set(dict(model().named_parameters()))
    assert {
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "layers.1.feed_forward.w2.weight",
        "layers.1.ffn_norm.weight",
        "norm.weight",
        "output.weight",
    } <= names
    assert not any("rope" in n for n in model().state_dict())  # RoPE tables are not saved


def test_sampling_is_reproducible_with_a_generator():
    m = model()
    a = sample(m, [1, 2, 3], 8, generator=torch.Generator().manual_seed(1))
    b = sample(m, [1, 2, 3], 8, generator=torch.Generator().manual_seed(1))
    assert a == b and len(a) == 11 and a[:3] == [1, 2, 3]


def materialized(cfg: ModelConfig, seed: int) -> Transformer:
    with torch.device("meta"):
        m = Transformer(cfg)
    m.materialize("cpu")
    m.init_weights(seed=seed)
    return m


def test_meta_build_then_materialize_equals_a_direct_build():
    direct = Transformer(CFG)
    direct.init_weights(seed=7)
    meta = materialized(CFG, 7)
    for name, p in direct.state_dict().items():
        assert torch.equal(p, meta.state_dict()[name]), name
    x = torch.randint(0, 259, (1, 16))
    assert torch.equal(direct(x), meta(x))


def test_materialize_keeps_tied_embeddings_tied():
    m = materialized(attrs.evolve(CFG, tie_embeddings=True), 1)
    assert m.output.weight is m.tok_embeddings.weight


def test_initial_values_depend_on_name_and_seed_only():
    from forge.model.init import initial_value

    a = initial_value("layers.0.attention.wq.weight", (4, 4), CFG, 1)
    assert torch.equal(a, initial_value("layers.0.attention.wq.weight", (4, 4), CFG, 1))
    assert not torch.equal(a, initial_value("layers.1.attention.wq.weight", (4, 4), CFG, 1))
    assert not torch.equal(a, initial_value("layers.0.attention.wq.weight", (4, 4), CFG, 2))
    assert torch.equal(initial_value("norm.weight", (4,), CFG, 1), torch.ones(4))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    from forge.config.sections import ActivationCheckpointing
    from forge.model.transformer import canonical_name
    from forge.parallel.parallelize import apply_activation_checkpointing

    plain, wrapped = model(), model()
    apply_activation_checkpointing(wrapped, ActivationCheckpointing(mode))
    x = torch.randint(0, 259, (2, 16))
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    grads = {canonical_name(n): p.grad for n, p in wrapped.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    kinds = [type(b).__name__ for b in wrapped.layers.values()]
    assert kinds == (
        ["CheckpointWrapper"] * 2 if mode == "full" else ["CheckpointWrapper", "TransformerBlock"]
    )


def test_qk_norm_adds_one_norm_per_head_dimension_for_queries_and_keys():
    m = model(qk_norm=True)
    names = {n for n, _ in m.named_parameters() if "q_norm" in n or "k_norm" in n}
    assert names == {f"layers.{i}.attention.{w}_norm.weight" for i in range(2) for w in "qk"}
    assert all(
        p.shape == (8,) and bool((p == 1).all()) for n, p in m.named_parameters() if n in names
    )
    assert num_parameters(m) == num_parameters(model()) + 2 * 2 * 8


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(qk_norm):
    """RMSNorm(c q) = RMSNorm(q): scaling wq and wk changes nothing with qk_norm, and changes
    the logits without it."""
    m = model(qk_norm=qk_norm, norm_eps=1e-12)  # eps would blur the invariance
    x = torch.randint(0, 259, (2, 16))
    before = m(x)
    with torch.no_grad():
        for block in m.layers.values():
            block.attention.wq.weight.mul_(7.0)
            block.attention.wk.weight.mul_(0.3)
    after = m(x)
    assert torch.allclose(before, after, atol=1e-4) is qk_norm


def test_qk_norm_weights_learn():
    m = model(qk_norm=True)
    m(torch.randint(0, 259, (2, 16))).sum().backward()
    grad = m.layers["0"].attention.q_norm.weight.grad
    assert grad is not None and bool(grad.abs().sum() > 0)


def test_a_head_size_of_its_own_shapes_every_part_of_attention():
    """``model.head_dim`` (Qwen3's: wider than dim / n_heads) sizes the projections, the q/k
    norms and the RoPE tables; the model trains like any other."""
    m = model(head_dim=12, qk_norm=True)
    attention = m.layers["0"].attention
    assert attention.wq.weight.shape == (4 * 12, 32) and attention.wo.weight.shape == (32, 48)
    assert attention.wk.weight.shape == attention.wv.weight.shape == (2 * 12, 32)
    assert attention.q_norm is not None and attention.q_norm.weight.shape == (12,)
    assert m.rope_cos.shape == (16, 6)
    x = torch.randint(0, 259, (2, 16))
    m(x).sum().backward()
    assert attention.wq.weight.grad is not None


def test_rope_scaling_changes_only_the_low_frequencies():
    """Llama 3.1's scaling keeps the wavelengths below original / high_freq_factor, slows
    those above original / low_freq_factor by ``factor`` and interpolates between."""
    from forge.config.sections import RopeScaling

    scaling = RopeScaling(factor=8.0, original_max_seq_len=32)  # bands at 8 and 32
    cos, sin = rope_tables(16, 2, 10000.0)
    freqs = torch.atan2(sin[1], cos[1])  # position 1: the angle is the frequency
    cos, sin = rope_tables(16, 2, 10000.0, scaling)
    got = torch.atan2(sin[1], cos[1])
    wavelengths = 2 * math.pi / freqs
    kept, slowed = wavelengths < 8, wavelengths > 32
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()
    torch.testing.assert_close(got[kept], freqs[kept])
    torch.testing.assert_close(got[slowed], freqs[slowed] / 8)
    between = ~kept & ~slowed
    assert bool(((got[between] < freqs[between]) & (got[between] > freqs[between] / 8)).all())
