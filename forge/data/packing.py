"""Packed sequences: several documents in one row, kept apart.

Documents are framed as ``BOS ... EOS`` by ``scripts/prepare_data.py``, so a row's document ids
follow from where its BOS tokens are: no side table is needed. A row may start inside a
document (id 0 until the first BOS).
"""

from __future__ import annotations

import attrs
import torch

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index


@attrs.frozen
class Packed:
    inputs: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T); IGNORE_INDEX where the next token is another document's
    positions: torch.Tensor  # (B, T); RoPE positions, 0 at each document's first token
    document_ids: torch.Tensor  # (B, T); the attention mask is block-diagonal over these


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Per-token document index within each row: +1 at every BOS."""
    return torch.cumsum(tokens == bos_id, dim=-1)


def positions_in_document(ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document (restarting at 0 where the id changes)."""
    index = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(start_index, dim=-1).values


def pack(tokens: torch.Tensor, bos_id: int) -> Packed:
    """Inputs, labels, positions and document ids of windows ``(B, T + 1)``."""
    ids = document_ids(tokens, bos_id)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    crosses = ids[:, 1:] != ids[:, :-1]  # the next token opens another document
    return Packed(
        inputs=inputs,
        labels=labels.masked_fill(crosses, IGNORE_INDEX),
        positions=positions_in_document(ids[:, :-1]),
        document_ids=ids[:, :-1],
    )
