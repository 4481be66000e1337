"""Cached generation equals recomputing the whole context; filters; the context limit."""

from __future__ import annotations

import attrs
import pytest
import torch

from forge.config import ModelConfig
from forge.config.sections import RopeScaling
from forge.model.generate import filter_logits, sample
from forge.model.transformer import KVCache, Transformer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24)


def model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(attrs.evolve(CFG, **kw)).eval()


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"n_kv_heads": 4},
        {"qk_norm": True},
        {"tie_embeddings": True},
        {"head_dim": 24, "qk_norm": True},  # Qwen3's head, not dim / n_heads: the cache's size
        {"rope_scaling": RopeScaling(factor=4.0, original_max_seq_len=8)},
    ],
    ids=str,
)
@torch.no_grad()
def test_cached_logits_equal_the_full_context_at_every_position(kw):
    """A prefill of 5 tokens, then 1, then a chunk of 3, then 1 at a time."""
    m = model(**kw)
    tokens = torch.randint(0, 259, (1, 20), generator=torch.Generator().manual_seed(1))
    full = m(tokens)
    cache = KVCache(m.cfg)
    pieces, start = [5, 1, 3, 1, 1, 9], 0
    for n in pieces:
        got = m(tokens[:, start : start + n], cache=cache)
        torch.testing.assert_close(got, full[:, start : start + n], atol=1e-5, rtol=1e-5)
        start += n
    assert cache.length == 20


def test_greedy_with_the_cache_equals_greedy_recomputing_everything():
    m = model()
    cached = sample(m, [1, 2, 3], 20, temperature=0)
    uncached = sample(m, [1, 2, 3], 20, temperature=0, use_cache=False)
    assert cached == uncached and len(cached) == 23


def test_sampling_with_the_cache_equals_sampling_without():
    m = model()
    runs = [
        sample(m, [5], 16, temperature=0.9, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(3), use_cache=c)
        for c in (True, False)
    ]  # fmt: skip
    assert runs[0] == runs[1]


def test_positions_past_max_seq_len_are_refused():
    m = model()
    with pytest.raises(ValueError, match=r"exceed model\.max_seq_len=24; ask for at most 21"):
        sample(m, [1, 2, 3], 22)
    cache = KVCache(m.cfg)
    m(torch.zeros(1, 24, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"position 25 is past model\.max_seq_len=24"):
        m(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_generation_stops_after_the_stop_token():
    m = model()
    free = sample(m, [1, 2, 3], 10, temperature=0)
    stop = free[5]  # the third generated token
    stopped = sample(m, [1, 2, 3], 10, temperature=0, stop_id=stop)
    assert stopped == free[: free.index(stop, 3) + 1]


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

# (top_k, top_p, the tokens left)
FILTERS = [
    (None, None, [0, 1, 2, 3]),
    (2, None, [0, 1]),
    (0, None, [0, 1, 2, 3]),  # 0: all
    (None, 0.5, [0]),  # the first token alone reaches 0.5
    (None, 0.6, [0, 1]),
    (None, 0.8, [0, 1]),  # 0.5 + 0.3 reaches 0.8
    (None, 0.81, [0, 1, 2]),
    (None, 1.0, [0, 1, 2, 3]),
    (3, 0.6, [0, 1]),  # both apply
    (1, 1.0, [0]),
]


@pytest.mark.parametrize(("top_k", "top_p", "left"), FILTERS)
def test_top_k_and_top_p_keep_the_likeliest_tokens(top_k, top_p, left):
    kept = torch.isfinite(filter_logits(LOGITS, top_k, top_p)).nonzero().flatten().tolist()
    assert kept == left
