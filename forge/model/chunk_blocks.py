"""How the chunked loss lays out its work on a CPU: which chunks run their tail a few rows at
a time (``chunk_plan``), the buffers every chunk reuses, the row blocks (never a lone row) and
the fp32 sum of the output weight's gradient built through a small block. Each piece keeps
the bits of whole chunks; ``forge.model.chunked_loss`` computes with them."""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch

# Rows of a chunk's tail at a time on a CPU: 32 rows of fp32 logits (4 MiB at vocab 32k) stay
# in the cache between its passes; a whole chunk's (32 MiB) go to memory and back at each one.
# (16 to 64 measured alike; the tail of a 256-token chunk took 8 ms in blocks of 32, 12 whole.)
CPU_ROWS_PER_PASS = 32
# On a CPU the output weight's gradient joins its fp32 sum through a block of this many bytes
# (each few rows converted in it while it stays in the cache; 0: one converted copy of all).
CPU_BYTES_PER_ADD = 8 << 20


@attrs.frozen
class ChunkPlan:
    """How one loss call runs its chunks: the tail ``rows_per_pass`` rows at a time (0: each
    chunk whole), into ``ChunkBuffers`` reused by every chunk or not, and the weight's gradient
    converted into its fp32 sum through a block of ``add_bytes`` (0: a converted copy of all)."""

    rows_per_pass: int
    buffers: bool
    add_bytes: int


def chunk_plan(
    device_type: str,
    tp: bool,
    compiled: bool,
    with_grad: bool,
    dtype: torch.dtype,
    tokens: int,
    chunk_size: int,
) -> ChunkPlan:
    """Blocks and buffers only where they pay: the row blocks eager on a CPU without TP (under
    TP each pass would be two collectives; inductor fuses a compiled chunk's passes itself;
    a GPU's passes are kernels over the whole chunk), buffers when gradients are made, the add
    block on a CPU when several chunks' gradients in a narrower dtype than fp32 are summed."""
    cpu = device_type == "cpu"
    rows = CPU_ROWS_PER_PASS if cpu and not tp and not compiled else 0
    narrower = dtype != torch.float32 and torch.promote_types(dtype, torch.float32) == torch.float32
    converts = cpu and with_grad and narrower and tokens > chunk_size
    return ChunkPlan(
        rows_per_pass=rows,
        buffers=bool(rows) and with_grad and tokens > 0,
        add_bytes=CPU_BYTES_PER_ADD if converts else 0,
    )


class ChunkBuffers(NamedTuple):
    """Tensors one loss call reuses for every chunk, in the compute dtype: the chunk's logits,
    their gradient (not in fp32: fp32 logits hold their own) and the output weight's gradient.
    A tensor made afresh for each chunk is new memory each time, paid for in page faults."""

    logits: torch.Tensor  # (chunk, V_local)
    grad: torch.Tensor | None  # (chunk, V_local)
    grad_weight: torch.Tensor  # (V_local, D)


def chunk_buffers(chunk: int, weight: torch.Tensor, dtype: torch.dtype) -> ChunkBuffers:
    """Buffers for chunks of up to ``chunk`` tokens projected onto ``weight`` in ``dtype``."""
    v_local = weight.shape[0]
    return ChunkBuffers(
        weight.new_empty((chunk, v_local), dtype=dtype),
        None if dtype == torch.float32 else weight.new_empty((chunk, v_local), dtype=dtype),
        weight.new_empty(weight.shape, dtype=dtype),
    )


def add_block(weight: torch.Tensor, nbytes: int) -> torch.Tensor:
    """An fp32 block of the output weight's rows, at most ``nbytes``, for ``add_into``."""
    v_local, d = weight.shape
    rows = min(v_local, max(1, nbytes // (4 * d)))
    return weight.new_empty((rows, d), dtype=torch.float32)


def row_blocks(n: int, rows: int) -> list[slice]:
    """``n`` rows in blocks of ``rows`` (at least 2), none a single row of several: torch sums
    one long row in parallel pieces (another order than a row among others), so a lone row
    would change the bits."""
    starts = list(range(0, n, max(rows, 2)))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], n], strict=True)]


def sum_start(part: torch.Tensor, block: torch.Tensor | None) -> torch.Tensor:
    """The fp32 sum that starts with ``part``: ``0 + part``, so a -0.0 in it becomes +0.0 as in
    a sum started from zeros, without filling zeros first. A bf16 ``part`` is converted
    through ``block`` a few rows at a time (``add`` computes in its inputs' dtype: without a
    block a CPU makes a whole bf16 sum, then converts it)."""
    total = torch.empty(part.shape, dtype=torch.float32, device=part.device)
    if part.dtype == total.dtype or block is None:
        return torch.add(part, 0.0, out=total)
    rows = len(block)
    for start in range(0, len(part), rows):
        piece = part[start : start + rows]
        torch.add(block[: len(piece)].copy_(piece), 0.0, out=total[start : start + rows])
    return total


def add_into(total: torch.Tensor, part: torch.Tensor, block: torch.Tensor | None) -> None:
    """``total += part``, with ``part`` converted to ``total``'s dtype through ``block``, a few
    rows at a time (the same bits as one ``add_``, without a converted copy of all ``part``)."""
    if part.dtype == total.dtype or block is None:
        total.add_(part)
        return
    rows = len(block)
    for start in range(0, len(part), rows):
        piece = part[start : start + rows]
        total[start : start + rows].add_(block[: len(piece)].copy_(piece))
