"""Autoregressive sampling from a ``Transformer``."""

from __future__ import annotations

import torch

from forge.model.transformer import Transformer


@torch.no_grad()
def sample(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    stop_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Prompt plus up to ``max_new_tokens`` sampled ids (greedy when temperature is 0)."""
    model.eval()
    ids = list(prompt)
    window = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], dtype=torch.long)
        logits = model(context)[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        ids.append(nxt)
        if stop_id is not None and nxt == stop_id:
            break
    return ids
