"""Log-likelihoods and greedy continuations from a forge model, a batch of rows at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
from torch import nn

from forge.config import ModelConfig
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


@attrs.frozen
class Stops:
    """When greedy decoding ends: after an id of ``ids``, or once ``decode`` of the new ids
    holds one of ``texts`` (a request's ``until`` strings)."""

    ids: tuple[int, ...] = ()
    texts: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None

    def reached(self, new: list[int]) -> bool:
        """Whether decoding may stop after ``new``."""
        if new and new[-1] in self.ids:
            return True
        if self.decode is None or not any(self.texts):
            return False
        text = self.decode(new)
        return any(t and t in text for t in self.texts)


@torch.no_grad()
def greedy_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    steps: int,
    device: torch.device,
    *,
    stops: Stops = Stops(),
    use_cache: bool = True,
    pad_id: int = 0,
    multiple: int = 1,
) -> list[int]:
    """Up to ``steps`` greedily decoded ids after ``prompt``, ending where ``stops`` says.
    With ``use_cache`` decoding stops there, with a cache sized to this prompt and these
    steps; without it every step recomputes the context on rows right-padded to a multiple
    of ``multiple`` and all ``steps`` forwards run (ranks in lockstep under FSDP or TP make
    the same calls; the ids after the stop are dropped)."""
    ids = list(prompt)
    new: list[int] = []
    stopped = False
    cache = None
    if use_cache:
        full: ModelConfig = model.cfg  # type: ignore[assignment]
        cfg = attrs.evolve(full, max_seq_len=len(ids) + steps)
        cache = KVCache(cfg, dtype=next(model.parameters()).dtype, device=device)
    pending = ids
    for _ in range(steps):
        if cache is not None:
            logits, last = logits_of(model, torch.tensor([pending], device=device), cache), -1
        else:
            seen = ids + new
            row = seen + [pad_id] * (padded_length(len(seen), multiple) - len(seen))
            logits, last = logits_of(model, torch.tensor([row], device=device)), len(seen) - 1
        nxt = int(logits[0, last].argmax())
        if not stopped:
            new.append(nxt)
            stopped = stops.reached(new)
        pending = [nxt]
        if stopped and cache is not None:
            break
    return new
