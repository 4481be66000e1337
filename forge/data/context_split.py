"""Context parallelism's split of a sequence (``distributed.cp``): which tokens a rank keeps.

The sequence of ``T`` tokens is cut into ``2 × cp`` equal chunks; context-parallel rank ``i``
keeps chunks ``i`` and ``2 × cp − 1 − i`` (head–tail). Under a causal mask a query's work
grows with its position, so pairing an early chunk with a late one gives every rank the same
number of query–key pairs. Pure functions: the model's attention blocks follow the same
chunks (``forge.model.block_attention.key_blocks``).
"""

from __future__ import annotations

import attrs
import torch

from forge.data.batch import Batch


def head_tail_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global token indices (ascending, ``seq_len / cp`` of them) that context-parallel
    ``rank`` of ``cp`` keeps: chunks ``rank`` and ``2·cp − 1 − rank`` of ``2·cp``."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not a multiple of 2*cp={2 * cp}")
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in [0, {cp})")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail_start = (2 * cp - 1 - rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk)])


def context_shard(batch: Batch, cp: int, rank: int) -> Batch:
    """Rank ``rank``'s tokens of every row of ``batch``: inputs, labels and document ids, and
    the RoPE positions (the row's own ``arange(T)`` for rows that are one sequence, the packed
    ``batch.positions`` otherwise), all along the sequence dim. Row-wise fields (sources,
    images) are kept. ``cp`` 1: the batch as it is."""
    if cp == 1:
        return batch
    b, t = batch.inputs.shape
    index = head_tail_indices(t, cp, rank).to(batch.inputs.device)
    positions = batch.positions
    if positions is None:
        positions = torch.arange(t, device=batch.inputs.device).expand(b, t)

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.index_select(1, index)

    return attrs.evolve(
        batch,
        inputs=cut(batch.inputs),
        labels=cut(batch.labels),
        positions=cut(positions),
        document_ids=cut(batch.document_ids),
    )
