"""Autoregressive sampling from a ``Transformer`` (prefill, then cached decoding), and
captions from a vision-language model."""

from __future__ import annotations

import torch

from forge.model.transformer import KVCache, Transformer, split_moe_output
from forge.model.vlm import VisionLanguageModel


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """``logits`` with every token outside the ``top_k`` likeliest, or outside the smallest
    set whose probability reaches ``top_p`` (nucleus), set to -inf. ``None``/0 and 1.0: off."""
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
        drop = before >= top_p  # a token stays if the ones above it fall short of top_p
        unsorted = torch.zeros_like(drop).scatter(-1, order, drop)
        logits = logits.masked_fill(unsorted, float("-inf"))
    return logits


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> int:
    """Greedy at temperature 0, else a sample from the filtered, tempered distribution."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
    if generator is not None:  # drawn where the generator lives: a seed gives one text anywhere
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def check_room(prompt: list[int], max_new_tokens: int, limit: int) -> None:
    """``ValueError`` unless ``prompt`` has a token and it and ``max_new_tokens`` more fit
    ``model.max_seq_len=limit`` (the model has no RoPE positions past it)."""
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token")
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens exceed "
            f"model.max_seq_len={limit}; ask for at most {max(0, limit - len(prompt))} new tokens"
        )


@torch.no_grad()
def sample(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    top_p: float | None = None,
    stop_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Prompt plus up to ``max_new_tokens`` sampled ids, stopping after ``stop_id``.

    With ``use_cache`` the prompt is run once (prefill) and each new token reuses the cached
    keys and values; without it every token recomputes the whole context (the reference the
    tests compare against). Positions past ``model.max_seq_len`` are refused (``ValueError``):
    the model has no RoPE positions there, and sliding the window would change the text.
    """
    check_room(prompt, max_new_tokens, model.cfg.max_seq_len)
    model.eval()
    device = next(model.parameters()).device
    ids = list(prompt)
    cache = KVCache(model.cfg, dtype=next(model.parameters()).dtype, device=device)
    pending = ids  # the tokens the model has not seen yet
    for _ in range(max_new_tokens):
        if use_cache:
            output = model(torch.tensor([pending], device=device), cache=cache)
        else:
            output = model(torch.tensor([ids], device=device))
        logits = split_moe_output(output, model.cfg.moe)[0][0, -1]
        nxt = next_token(logits.float(), temperature, top_k, top_p, generator)
        ids.append(nxt)
        pending = [nxt]
        if stop_id is not None and nxt == stop_id:
            break
    return ids


@torch.no_grad()
def caption(
    model: VisionLanguageModel,
    image: torch.Tensor,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Prompt plus up to ``max_new_tokens`` ids continuing it about ``image`` (``uint8``
    ``(H, W, 3)``), stopping after ``stop_id``; greedy at temperature 0. Each token reruns
    the whole caption (captions are short; the image tokens are encoded once)."""
    if not prompt:
        raise ValueError("the prompt is empty: a caption starts from at least the BOS token")
    model.eval()
    device = next(model.parameters()).device
    image_tokens = model.image_tokens(image.unsqueeze(0).to(device))
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model.decode(torch.tensor([ids], device=device), image_tokens)[0, -1]
        nxt = next_token(logits.float(), temperature, top_k, top_p, generator)
        ids.append(nxt)
        if stop_id is not None and nxt == stop_id:
            break
    return ids
