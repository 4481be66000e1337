"""Log-likelihoods and greedy continuations from a forge model, a batch of rows at a time."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from forge.harness.requests import Row, padded_length
from forge.model.transformer import KVCache, split_moe_output


def logits_of(model: nn.Module, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """The model's logits ``(B, T, V)`` for ``tokens`` in fp32 (a mixture of experts'
    statistics dropped); with a ``cache``, ``tokens`` continue the cached positions."""
    output = model(tokens) if cache is None else model(tokens, cache=cache)
    return split_moe_output(output, model.cfg.moe)[0].float()  # type: ignore[union-attr]


@torch.no_grad()
def score_rows(
    model: nn.Module, rows: Sequence[Row], device: torch.device, pad_id: int, multiple: int = 1
) -> list[tuple[float, bool]]:
    """``(log-likelihood of the scored tokens, whether greedy decoding gives them)`` per row,
    in one forward over the rows right-padded to a common length (a multiple of
    ``multiple``). Padding sits after every scored token, so causal attention never sees it."""
    width = padded_length(max(len(r.inputs) for r in rows), multiple)
    batch = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, : len(row.inputs)] = torch.tensor(row.inputs)
    logits = logits_of(model, batch.to(device))
    out = []
    for i, row in enumerate(rows):
        end = len(row.inputs)
        # in float64 over the scored positions alone: sums of hundreds of terms stay exact
        # to 1e-6, and no (B, T, V) float64 tensor is ever made
        picked = torch.log_softmax(logits[i, end - row.scored : end].double(), dim=-1)
        target = torch.tensor(row.tokens[-row.scored :], device=picked.device)
        total = picked.gather(-1, target[:, None]).sum()
        greedy = bool((picked.argmax(-1) == target).all())
        out.append((float(total), greedy))
    return out


@torch.no_grad()
def greedy_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    steps: int,
    device: torch.device,
    *,
    stop_ids: Sequence[int] = (),
    use_cache: bool = True,
    pad_id: int = 0,
    multiple: int = 1,
) -> list[int]:
    """Up to ``steps`` greedily decoded ids after ``prompt`` (stopping after a ``stop_ids``
    id). Without ``use_cache`` every step recomputes the context and runs all ``steps``
    forwards, on rows right-padded to a multiple of ``multiple`` (ranks in lockstep under
    FSDP or TP make the same calls)."""
    ids = list(prompt)
    new: list[int] = []
    stopped = False
    cache = KVCache(model.cfg, dtype=next(model.parameters()).dtype, device=device)  # type: ignore[arg-type]
    pending = ids
    for _ in range(steps):
        if use_cache:
            logits = logits_of(model, torch.tensor([pending], device=device), cache)
            last = -1
        else:
            seen = ids + new
            row = seen + [pad_id] * (padded_length(len(seen), multiple) - len(seen))
            logits, last = logits_of(model, torch.tensor([row], device=device)), len(seen) - 1
        nxt = int(logits[0, last].argmax())
        if not stopped:
            new.append(nxt)
            stopped = nxt in stop_ids
        pending = [nxt]
        if stopped and use_cache:
            break
    return new
