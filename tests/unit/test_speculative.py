"""Self-speculative generation (``forge.model.speculative``): greedy output identical to plain
greedy decoding, sampled output distributed as the plain sampler's (a chi-square test against
the exact distribution, which a sampler that keeps every draft fails), and the refusals."""

from __future__ import annotations

import collections
import math

import attrs
import pytest
import torch

import forge.model.speculative as speculative
from forge.config.model import ModelConfig
from forge.model.generate import sample
from forge.model.speculative import speculation_problem, speculative_sample
from forge.model.transformer import Transformer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=64, mtp_depth=2)


def model(cfg: ModelConfig = CFG, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


@pytest.mark.parametrize(
    "cfg",
    [
        CFG,
        attrs.evolve(CFG, mtp_depth=3),
        attrs.evolve(CFG, moe_num_experts=4, mtp_depth=1),
        attrs.evolve(CFG, moe_num_experts=4, mtp_moe=True),
    ],
    ids=["depth 2", "depth 3", "moe depth 1", "moe depths' blocks"],
)
def test_greedy_speculative_output_is_plain_greedy_output(cfg):
    m = model(cfg)  # untrained depths draft poorly: their drafts are rejected, output kept
    gen = torch.Generator().manual_seed(7)
    kept = drafted = 0
    for i in range(20):
        prompt = torch.randint(0, 64, (1 + i % 7,), generator=gen).tolist()
        new = 30 - i % 5
        expected = sample(m, prompt, new, temperature=0)
        got, spec = speculative_sample(m, prompt, new, temperature=0)
        assert got == expected, i
        kept, drafted = kept + spec.accepted, drafted + spec.drafted
    assert drafted > 0


def test_greedy_with_trained_looking_depths_keeps_drafts_and_saves_forwards():
    """Drafts that are right (an oracle drafting what plain greedy decoding produces next) are
    all kept: fewer main forwards than tokens, the output unchanged."""
    m = model()
    prompt = [3, 1, 4, 1, 5]
    expected = sample(m, prompt, 40, temperature=0)

    def oracle(ids, n, count, choose):  # drafts what plain greedy will produce next
        full = expected
        drafts = [full[n + k] for k in range(1, count + 1) if n + k < len(full)]
        return drafts, [None] * len(drafts)

    original = speculative.Drafter.draft
    speculative.Drafter.draft = lambda self, ids, n, count, choose: oracle(ids, n, count, choose)
    try:
        got, spec = speculative_sample(m, prompt, 40, temperature=0)
    finally:
        speculative.Drafter.draft = original
    assert got == expected
    assert spec.accepted == spec.drafted > 0 and spec.forwards < 40


def exact_distribution(m: Transformer, prompt: list[int], vocab: int) -> dict[tuple, float]:
    """The plain sampler's probability of every 3-token continuation (temperature 1)."""
    with torch.no_grad():

        def p(prefix: list[int]) -> torch.Tensor:
            return torch.softmax(m(torch.tensor([prefix]))[0, -1].float(), -1)

        out = {}
        pa = p(prompt)
        for a in range(vocab):
            pb = p([*prompt, a])
            for b in range(vocab):
                pc = p([*prompt, a, b])
                for c in range(vocab):
                    out[(a, b, c)] = (pa[a] * pb[b] * pc[c]).item()
    return out


def chi_square(counts: collections.Counter, exact: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the cells expected at least 5 times, the rest pooled; its
    degrees of freedom."""
    big = {k: v for k, v in exact.items() if v * n >= 5}
    rest = 1 - sum(big.values())
    stat = sum((counts[k] - n * v) ** 2 / (n * v) for k, v in big.items())
    other = n - sum(counts[k] for k in big)
    if rest * n > 0:
        stat += (other - n * rest) ** 2 / (n * rest)
    return stat, len(big)


def quantile_999(df: int) -> float:
    """The chi-square 0.999 quantile (Wilson–Hilferty: within 1% here)."""
    z = 3.090
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


SMALL = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=4, max_seq_len=16, mtp_depth=2,
                    init_std=0.5)  # fmt: skip


def sampled(m: Transformer, n: int) -> tuple[collections.Counter, int, int]:
    gen = torch.Generator().manual_seed(0)
    counts: collections.Counter = collections.Counter()
    kept = drafted = 0
    for _ in range(n):
        ids, spec = speculative_sample(m, [1, 2], 3, temperature=1.0, top_k=None, generator=gen)
        counts[tuple(ids[2:])] += 1
        kept, drafted = kept + spec.accepted, drafted + spec.drafted
    return counts, kept, drafted


def test_sampled_speculative_output_has_the_plain_samplers_distribution(monkeypatch):
    m = model(SMALL)
    n = 1000
    exact = exact_distribution(m, [1, 2], 4)
    counts, kept, drafted = sampled(m, n)
    assert 0 < kept < drafted  # drafts both kept and rejected: both paths are in the test
    stat, df = chi_square(counts, exact, n)
    assert stat < quantile_999(df), (stat, df)

    # the same test catches a sampler that keeps every draft (q taken for p)
    def keep_all(drafts, dists, logits, choose, *rest):
        return list(drafts), choose(logits[len(drafts)])[0]

    monkeypatch.setattr(speculative, "verify", keep_all)
    counts, _, _ = sampled(m, n)
    assert chi_square(counts, exact, n)[0] > quantile_999(df)


@pytest.mark.parametrize(
    ("cfg", "fragment"),
    [
        (attrs.evolve(CFG, mtp_depth=0), "no multi-token depths"),
        (attrs.evolve(CFG, sliding_window=8), "model.sliding_window"),
        (attrs.evolve(CFG, moe_num_experts=4, moe_capacity_factor=1.0), "moe_capacity_factor"),
    ],
)
def test_a_model_that_cannot_draft_is_refused_by_name(cfg, fragment):
    m = model(cfg)
    problem = speculation_problem(m)
    assert problem is not None and fragment in problem
    with pytest.raises(ValueError, match="--speculative"):
        speculative_sample(m, [1, 2], 4, temperature=0)
