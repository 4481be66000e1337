"""Self-speculative generation: a model's multi-token depths (``model.mtp_depth``) draft the
next tokens, the main model checks them all in one forward.

Each round, with the main model's cache holding positions ``0 … n-1`` and token ``n`` chosen:
depth k, at position n - 1, drafts token n + k from the previous depth's hidden state there
and the embedding of token n - 1 + k (the chosen token, or the previous depth's draft); the
main model then runs token n and the drafts at once, and its choices decide. Greedy: the
drafts are kept while they equal the main model's argmax, and the main model's own choice
follows the last kept one — the output is the plain greedy decoding's. Sampling: speculative
sampling (Leviathan et al. 2023; Chen et al. 2023): draft d from the depth's distribution q
is kept with probability ``min(1, p(d) / q(d))``, else the token is drawn from
``max(0, p - q)`` normalised, and the round ends — every token is distributed as the plain
sampler's ``p`` (the same temperature, top-k and top-p).

Each depth keeps its own one-block cache; its positions whose inputs are all decided stay,
the others (built on drafts) are computed again in the next round.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from forge.model.generate import check_room, filter_logits
from forge.model.moe import empty_stats
from forge.model.mtp import MTPModule
from forge.model.transformer import KVCache, Transformer, split_moe_output


@attrs.frozen
class Speculation:
    """What a speculative generation did: the tokens drafted, those kept, the main model's
    forwards (the prefill included)."""

    drafted: int = 0
    accepted: int = 0
    forwards: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def speculation_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot draft for itself, if it cannot."""
    if not isinstance(model, Transformer) or model.mtp is None:
        return (
            "--speculative: the model has no multi-token depths (model.mtp_depth = 0); "
            "train with model.mtp_depth > 0, or drop --speculative"
        )
    if model.cfg.sliding_window:
        return "--speculative: not supported with model.sliding_window yet; drop --speculative"
    if model.cfg.moe and model.cfg.moe_capacity_factor > 0:  # capacity depends on the tokens
        return (
            "--speculative: not supported with model.moe_capacity_factor > 0 (a forward of "
            "several tokens may drop what one token at a time never does); drop --speculative"
        )
    return None


def probabilities(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """The plain sampler's distribution over the next token (``next_token``'s)."""
    return torch.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    if generator is not None:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


class Drafter:
    """The depths' caches and hidden states over the positions decided so far."""

    def __init__(self, model: Transformer, length: int) -> None:
        assert model.mtp is not None
        cfg, param = model.cfg, next(model.parameters())
        one_block = attrs.evolve(cfg, n_layers=1)
        self.model = model
        self.depths = [m for _, m in sorted(model.mtp.items(), key=lambda kv: int(kv[0]))]
        self.caches = [
            KVCache(one_block, dtype=param.dtype, device=param.device) for _ in self.depths
        ]
        # hidden[k][i]: depth k's output at position i (k = 0: the main model's last block)
        self.hidden = [
            torch.zeros(length, cfg.dim, dtype=param.dtype, device=param.device)
            for _ in range(len(self.depths) + 1)
        ]

    def draft(self, ids: list[int], n: int, count: int, choose) -> tuple[list[int], list]:
        """``count`` drafts of tokens ``n + 1 …`` (``ids`` holds tokens ``0 … n``, the main
        model's hidden states of positions ``0 … n-1`` are in ``hidden[0]``), each chosen by
        ``choose(logits) -> (token, distribution or None)``; then each depth's cache keeps
        only its positions built on decided tokens."""
        drafts: list[int] = []
        dists: list = []
        decided = n  # positions of the previous depth whose inputs are all decided
        embed, head = self.model.tok_embeddings, self.model.output
        assert embed is not None and head is not None
        known = list(ids)  # the decided tokens, then each draft as it is made
        for k in range(1, count + 1):
            module, cache = self.depths[k - 1], self.caches[k - 1]
            assert isinstance(module, MTPModule)
            start = cache.length
            tokens = known[start + k : n + k]
            x = self.hidden[k - 1][start:n][None]
            emb = embed(torch.tensor([tokens], device=x.device))
            cos = self.model.rope_cos[start:n]
            sin = self.model.rope_sin[start:n]
            layer_cache = (cache.keys[0], cache.values[0], start)
            out, normed, _ = module(x, emb, cos, sin, None, layer_cache, self.stats(x.device))
            self.hidden[k][start:n] = out[0]
            token, dist = choose(head(normed[0, -1]))
            drafts.append(token)
            known.append(token)
            dists.append(dist)
            # decided: the previous depth's decided positions whose token i + k is in ids
            decided = max(0, min(decided, n - k + 1))
            cache.length = decided
        for k in range(count + 1, len(self.depths) + 1):  # depths not run: nothing new
            self.caches[k - 1].length = max(0, min(self.caches[k - 1].length, n - k + 1))
        return drafts, dists

    def stats(self, device: torch.device) -> torch.Tensor | None:
        """The MoE statistics a depth's mixture-of-experts block takes (``model.mtp_moe``;
        discarded: generation keeps none), or None for dense depth blocks."""
        return empty_stats(self.model.cfg, device) if self.model.cfg.mtp_moe else None


@torch.no_grad()
def speculative_sample(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    top_p: float | None = None,
    stop_id: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], Speculation]:
    """``forge.model.generate.sample``'s output (greedy: the same tokens; sampled: the same
    distribution), the depths drafting for the main model; with what the drafting did."""
    problem = speculation_problem(model)
    if problem is not None:
        raise ValueError(problem)
    limit = model.cfg.max_seq_len
    check_room(prompt, max_new_tokens, limit)
    model.eval()
    param = next(model.parameters())
    cache = KVCache(model.cfg, dtype=param.dtype, device=param.device)
    drafter = Drafter(model, limit)
    greedy = temperature <= 0

    def choose(logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if greedy:
            return int(logits.argmax()), None
        probs = probabilities(logits, temperature, top_k, top_p)
        return draw(probs, generator), probs

    def main_forward(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, logits) of ``tokens`` continuing the cache."""
        out = model(torch.tensor([tokens], device=param.device), cache=cache, hidden=True)
        h = split_moe_output(out, model.cfg.moe)[0][0]
        assert model.norm is not None and model.output is not None
        return h, model.output(model.norm(h))

    ids = list(prompt)
    if max_new_tokens == 0:
        return ids, Speculation()
    h, logits = main_forward(ids)
    drafter.hidden[0][: len(ids)] = h
    ids.append(choose(logits[-1])[0])
    drafted = accepted = 0
    forwards = 1
    while len(ids) - len(prompt) < max_new_tokens and (stop_id is None or ids[-1] != stop_id):
        n = len(ids) - 1  # the main model has seen positions 0 … n-1; token n is chosen
        room = max_new_tokens - (len(ids) - len(prompt))  # new tokens still wanted
        count = min(len(drafter.depths), room - 1)
        drafts, dists = drafter.draft(ids, n, count, choose) if count > 0 else ([], [])
        h, logits = main_forward([ids[n], *drafts])
        forwards += 1
        kept, last = verify(drafts, dists, logits, choose, temperature, top_k, top_p, generator)
        drafted += len(drafts)
        accepted += len(kept)
        cache.length = n + 1 + len(kept)  # the rejected drafts' keys are overwritten later
        drafter.hidden[0][n : n + 1 + len(kept)] = h[: len(kept) + 1]
        new = [*kept, last]
        if stop_id is not None and stop_id in new:
            new = new[: new.index(stop_id) + 1]
        ids += new[:room]
    return ids, Speculation(drafted, accepted, forwards)


def verify(
    drafts: list[int],
    dists: list,
    logits: torch.Tensor,
    choose,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """(the drafts kept, the token after them) given the main model's ``logits`` at token n
    and at each draft: greedy keeps a draft equal to the main model's choice; sampling keeps
    it with probability ``min(1, p / q)`` and otherwise draws from the residual."""
    kept: list[int] = []
    for j, (token, q) in enumerate(zip(drafts, dists, strict=True)):
        if q is None:  # greedy
            choice = int(logits[j].argmax())
            if choice != token:
                return kept, choice
            kept.append(token)
            continue
        p = probabilities(logits[j], temperature, top_k, top_p)
        ratio = (p[token] / q[token]).clamp(max=1.0)
        u = torch.rand((), generator=generator, device=generator.device if generator else "cpu")
        if u.item() < ratio.item():
            kept.append(token)
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        return kept, draw(residual / total if total > 0 else p, generator)
    return kept, choose(logits[len(drafts)])[0]
