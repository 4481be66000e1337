"""A mixture of experts' expert kernels and where their rows go: groups padded to the grouped
GEMM's alignment, fixed-capacity buffers, and which of the kernels a layer uses.

Every function here is sync-free: the sizes of what it builds are Python integers known
from the shapes alone (rows, experts, alignment, a bound), never read back from a tensor,
so a GPU never waits on the host for them and ``torch.compile`` sees static shapes. Rows
arrive sorted by expert, ``counts[e]`` of them for expert ``e`` (``forge.model.moe``'s
``sort_by_expert``), and ``counts.sum()`` equals the number of rows.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
import torch.nn.functional as F

# The CUDA grouped GEMM (CUTLASS, TMA loads) needs each group's start along the dimension its
# offsets cut to be 16-byte aligned: 8 rows of bf16, 4 of fp32 (torch's GroupMMCommon.cuh
# asserts it; inductor's autotuner builds its sample offsets the same way).
GROUP_ALIGNMENT_BYTES = 16

# The fixed-capacity buffers compute ``n_experts × bound`` rows for the real ones; past this
# ratio the extra matmul work costs more than the one host read of the per-expert loop.
MAX_BUFFER_ROW_RATIO = 2.0


class ExpertKernel(enum.Enum):
    """How a layer's expert matmuls run."""

    GROUPED = "grouped"  # torch._grouped_mm over the (padded) groups: one call per weight
    BUFFERED = "buffered"  # a bmm over fixed-capacity buffers (E, bound, dim): sync-free
    LOOP = "loop"  # one matmul per expert on its slice: reads the counts on the host


def expert_kernel(
    grouped: bool,
    device_type: str,
    rows: int,
    n_experts: int,
    bound: int | None,
    compiling: bool = False,
) -> ExpertKernel:
    """The kernel for ``rows`` rows over ``n_experts`` experts, each expert taking at most
    ``bound`` of them (None: unknown), in eager mode or under ``torch.compile``. The grouped
    GEMM where it is supported; else, on a GPU or under compile, the sync-free buffers when
    they compute at most ``MAX_BUFFER_ROW_RATIO`` × the real rows; else the loop. (In eager
    mode on a CPU a host read costs nothing, and the loop is the fastest; under compile the
    loop's host read is a graph break, and each new split of the rows a recompile.)"""
    if grouped:
        return ExpertKernel.GROUPED
    if (device_type != "cuda" and not compiling) or bound is None:
        return ExpertKernel.LOOP
    affordable = 0 < n_experts * bound <= MAX_BUFFER_ROW_RATIO * rows
    return ExpertKernel.BUFFERED if affordable else ExpertKernel.LOOP


def group_alignment(dtype: torch.dtype, device_type: str) -> int:
    """Rows each group is padded to a multiple of: 16 bytes' worth on a GPU, 1 (no padding)
    on a CPU, whose grouped GEMM takes any offsets."""
    if device_type != "cuda":
        return 1
    return max(1, GROUP_ALIGNMENT_BYTES // dtype.itemsize)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def padded_size(rows: int, n_groups: int, alignment: int) -> int:
    """Rows of the padded buffer: enough for any split of ``rows`` into ``n_groups`` groups
    each rounded up to ``alignment`` (at most ``alignment - 1`` more per group)."""
    return round_up(rows + n_groups * (alignment - 1), alignment)


def regroup(counts: torch.Tensor, rows: int, starts: torch.Tensor) -> torch.Tensor:
    """Where each of the ``rows`` rows goes when group ``e`` starts at row ``starts[e]``
    instead of at the sum of the counts before it: its rank within its group plus the new
    start, ``(rows,)`` int64."""
    ends = counts.cumsum(0)
    row = torch.arange(rows, device=counts.device)
    group = torch.searchsorted(ends, row, right=True)  # a group of zero rows holds no row
    return row - (ends - counts)[group] + starts[group]


class PaddedGroups(NamedTuple):
    """Groups padded to an alignment: each group's end row ``(E,)`` int32 (the grouped GEMM's
    ``offs``; the last group ends at ``size``, so that no row of the buffer is left
    unwritten), the padded row of each real row ``(rows,)``, and the buffer's rows."""

    offsets: torch.Tensor
    positions: torch.Tensor
    size: int


def pad_groups(counts: torch.Tensor, rows: int, alignment: int) -> PaddedGroups:
    """Pad each group of ``counts`` to a multiple of ``alignment`` rows. The padding rows are
    zeros (``pad_rows``), so they add nothing to a group's weight gradient and their outputs,
    dropped by ``strip_rows``, reach no token. The buffer's slack past the last real group
    goes to the last group: the offsets stay multiples of ``alignment``."""
    size = padded_size(rows, int(counts.shape[0]), alignment)
    padded = (counts + alignment - 1) // alignment * alignment
    ends = padded.cumsum(0)
    offsets = torch.cat([ends[:-1], ends.new_full((1,), size)]).to(torch.int32)
    return PaddedGroups(offsets, regroup(counts, rows, ends - padded), size)


def pad_rows(x: torch.Tensor, groups: PaddedGroups) -> torch.Tensor:
    """``x`` ``(rows, d)`` laid out in the padded groups, zeros between (its backward is a
    gather of the real rows)."""
    return x.new_zeros(groups.size, x.shape[-1]).index_copy(0, groups.positions, x)


def strip_rows(y: torch.Tensor, groups: PaddedGroups) -> torch.Tensor:
    """The real rows of a padded ``y``, in their original order: the inverse of ``pad_rows``."""
    return y.index_select(0, groups.positions)


def slot_positions(counts: torch.Tensor, rows: int, bound: int) -> torch.Tensor:
    """Each row's slot in fixed-capacity buffers of ``bound`` rows per group (group ``e``'s
    buffer starts at ``e × bound``). Every count must be at most ``bound``."""
    starts = torch.arange(int(counts.shape[0]), device=counts.device) * bound
    return regroup(counts, rows, starts)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU gate: ``silu(gate) * up``."""
    return F.silu(gate) * up


def padded_grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    alignment: int,
) -> torch.Tensor:
    """The experts by grouped GEMM, each group padded to ``alignment`` rows (1: as is)."""
    grouped_mm = torch._grouped_mm  # pyright: ignore[reportPrivateImportUsage]
    if alignment == 1:  # no copies where the kernel takes any offsets (a CPU)
        offsets = counts.cumsum(0).to(torch.int32)
        h = swiglu(grouped_mm(x, w1, offs=offsets), grouped_mm(x, w3, offs=offsets))
        return grouped_mm(h, w2, offs=offsets)
    groups = pad_groups(counts, x.shape[0], alignment)
    padded = pad_rows(x, groups)
    gate, up = (
        grouped_mm(padded, w1, offs=groups.offsets),
        grouped_mm(padded, w3, offs=groups.offsets),
    )
    return strip_rows(grouped_mm(swiglu(gate, up), w2, offs=groups.offsets), groups)


def buffered_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    bound: int,
) -> torch.Tensor:
    """The experts over fixed-capacity buffers ``(E, bound, dim)``, zeros past each expert's
    rows, by batched matmuls: no host read, ``E × bound`` rows computed. Every count must be
    at most ``bound``."""
    n_experts = w1.shape[0]
    slots = slot_positions(counts, x.shape[0], bound)
    buffer = x.new_zeros(n_experts * bound, x.shape[-1]).index_copy(0, slots, x)
    buffer = buffer.view(n_experts, bound, -1)
    h = swiglu(torch.bmm(buffer, w1), torch.bmm(buffer, w3))
    return torch.bmm(h, w2).view(n_experts * bound, -1).index_select(0, slots)
