"""The experts' row layouts: groups padded to the grouped GEMM's alignment, fixed-capacity
buffers, the kernel choice, and each kernel against the per-expert loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forge.model.expert_groups import (
    ExpertKernel,
    buffered_swiglu,
    expert_kernel,
    group_alignment,
    pad_groups,
    pad_rows,
    padded_grouped_swiglu,
    padded_size,
    slot_positions,
    strip_rows,
)
from forge.model.moe import grouped_swiglu

# (counts, alignment, offsets, positions), worked by hand: each group rounded up to the
# alignment, the buffer's slack (rows + E × (alignment - 1), rounded up) given to the last
PAD_CASES = [
    # 3 + 0 + 5 rows, 8-aligned: groups [0, 8) [8, 8) [8, 32); 29 -> 32 rows
    ([3, 0, 5], 8, [8, 8, 32], [0, 1, 2, 8, 9, 10, 11, 12]),
    # exact multiples: nothing moves; 16 + 2 × 7 = 30 -> 32 rows
    ([8, 8], 8, [8, 32], list(range(16))),
    # all rows on one expert (the middle one): the empty groups stay empty
    ([0, 6, 0], 8, [0, 8, 32], [0, 1, 2, 3, 4, 5]),
    # 16-aligned (fp8-class): 5 + 17 rows -> [0, 16) [16, 64); 22 + 30 = 52 -> 64 rows
    ([5, 17], 16, [16, 64], [0, 1, 2, 3, 4, *range(16, 33)]),
    # alignment 1 is the unpadded layout
    ([2, 0, 3], 1, [2, 2, 5], [0, 1, 2, 3, 4]),
    # every group empty but none of the rows lost: zero rows
    ([0, 0], 8, [0, 16], []),
]


@pytest.mark.parametrize(("counts", "alignment", "offsets", "positions"), PAD_CASES)
def test_pad_groups(counts, alignment, offsets, positions):
    rows = sum(counts)
    groups = pad_groups(torch.tensor(counts), rows, alignment)
    assert groups.offsets.dtype == torch.int32
    assert groups.offsets.tolist() == offsets
    assert groups.positions.tolist() == positions
    assert groups.size == offsets[-1] == padded_size(rows, len(counts), alignment)
    assert all(o % alignment == 0 for o in offsets)


@pytest.mark.parametrize(("counts", "alignment", "offsets", "positions"), PAD_CASES)
def test_strip_undoes_pad_and_the_padding_is_zeros(counts, alignment, offsets, positions):
    x = torch.randn(sum(counts), 4)
    groups = pad_groups(torch.tensor(counts), x.shape[0], alignment)
    padded = pad_rows(x, groups)
    assert padded.shape == (groups.size, 4)
    assert torch.equal(strip_rows(padded, groups), x)
    padding = torch.ones(groups.size, dtype=torch.bool)
    padding[groups.positions] = False
    assert torch.equal(padded[padding], torch.zeros(int(padding.sum()), 4))


@pytest.mark.parametrize(
    ("counts", "bound", "slots"),
    [
        ([3, 0, 5], 5, [0, 1, 2, 10, 11, 12, 13, 14]),
        ([0, 4], 4, [4, 5, 6, 7]),  # all on one expert, the buffer exactly full
        ([1, 1, 1], 2, [0, 2, 4]),
    ],
)
def test_slot_positions_in_fixed_capacity_buffers(counts, bound, slots):
    assert slot_positions(torch.tensor(counts), sum(counts), bound).tolist() == slots


@pytest.mark.parametrize(
    ("grouped", "device", "rows", "experts", "bound", "kernel"),
    [
        (True, "cuda", 4096, 8, 2048, ExpertKernel.GROUPED),
        (True, "cpu", 4096, 8, None, ExpertKernel.GROUPED),
        # no grouped GEMM on the GPU: buffers when they cost at most 2x the rows
        (False, "cuda", 4096, 8, 640, ExpertKernel.BUFFERED),  # capacity factor 1.25
        (False, "cuda", 4096, 8, 1024, ExpertKernel.BUFFERED),  # exactly 2x
        (False, "cuda", 4096, 8, 2048, ExpertKernel.LOOP),  # dropless top-2 of 8: 4x
        (False, "cuda", 4096, 2, 2048, ExpertKernel.BUFFERED),  # dropless top-2 of 2: 1x
        (False, "cuda", 4096, 8, None, ExpertKernel.LOOP),  # bound unknown (EP)
        (False, "cuda", 0, 8, 0, ExpertKernel.LOOP),  # nothing to compute
        (False, "cpu", 4096, 8, 640, ExpertKernel.LOOP),  # a CPU's host read is free
    ],
)
def test_expert_kernel_choice(grouped, device, rows, experts, bound, kernel):
    assert expert_kernel(grouped, device, rows, experts, bound) is kernel


@pytest.mark.parametrize(
    ("grouped", "device", "rows", "experts", "bound", "kernel"),
    [
        (True, "cpu", 4096, 8, 640, ExpertKernel.GROUPED),
        # the loop's host read is a graph break: the buffers where affordable, on any device
        (False, "cpu", 4096, 8, 640, ExpertKernel.BUFFERED),  # capacity factor 1.25
        (False, "cuda", 4096, 8, 640, ExpertKernel.BUFFERED),
        (False, "cpu", 4096, 8, 2048, ExpertKernel.LOOP),  # dropless top-2 of 8: 4x
        (False, "cpu", 4096, 8, None, ExpertKernel.LOOP),  # bound unknown (EP)
    ],
)
def test_expert_kernel_choice_under_compile(grouped, device, rows, experts, bound, kernel):
    assert expert_kernel(grouped, device, rows, experts, bound, compiling=True) is kernel


@pytest.mark.parametrize(
    ("dtype", "device", "alignment"),
    [
        (torch.bfloat16, "cuda", 8),
        (torch.float32, "cuda", 4),
        (torch.float8_e4m3fn, "cuda", 16),
        (torch.bfloat16, "cpu", 1),
        (torch.float32, "cpu", 1),
    ],
)
def test_group_alignment_is_16_bytes_on_a_gpu(dtype, device, alignment):
    assert group_alignment(dtype, device) == alignment


def loop_swiglu(x, counts, w1, w2, w3):
    """The reference: one matmul per expert on its slice."""
    rows = x.split(counts)
    outs = [(F.silu(r @ w1[e]) * (r @ w3[e])) @ w2[e] for e, r in enumerate(rows)]
    return torch.cat(outs)


def assert_equals_the_loop(kernel, counts, **kwargs):
    """Outputs and every gradient within 1e-6 of the per-expert loop (fp32)."""
    torch.manual_seed(1)
    x = torch.randn(sum(counts), 16, requires_grad=True)
    w1, w3 = (torch.randn(3, 16, 8, requires_grad=True) for _ in "ab")
    w2 = torch.randn(3, 8, 16, requires_grad=True)
    out = kernel(x, torch.tensor(counts), w1, w2, w3, **kwargs)
    expected = loop_swiglu(x, counts, w1, w2, w3)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, w1, w2, w3], grad)
    want = torch.autograd.grad(expected, [x, w1, w2, w3], grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


COUNT_CASES = [[3, 0, 5], [0, 0, 8], [8, 0, 0], [8, 8, 8]]


@pytest.mark.parametrize("alignment", [1, 8, 16])
@pytest.mark.parametrize("counts", COUNT_CASES)
def test_the_padded_grouped_gemm_equals_the_loop(counts, alignment):
    """torch 2.13 has a CPU ``_grouped_mm`` (fp32): the padded path runs here as on a GPU."""
    assert_equals_the_loop(padded_grouped_swiglu, counts, alignment=alignment)


@pytest.mark.parametrize("counts", COUNT_CASES)
def test_the_fixed_capacity_buffers_equal_the_loop(counts):
    assert_equals_the_loop(buffered_swiglu, counts, bound=max(max(counts), 1))


def test_the_padded_and_buffered_kernels_never_read_the_host():
    """The meta device has no data: a host read (``.tolist()``, ``.item()``, a boolean
    mask) fails there, so a kernel that runs on it builds every shape from Python ints."""
    counts = torch.tensor([3, 0, 5], device="meta")
    x = torch.empty(8, 16, device="meta", dtype=torch.bfloat16)
    w1, w3 = (torch.empty(3, 16, 8, device="meta", dtype=torch.bfloat16) for _ in "ab")
    w2 = torch.empty(3, 8, 16, device="meta", dtype=torch.bfloat16)
    assert padded_grouped_swiglu(x, counts, w1, w2, w3, alignment=8).shape == (8, 16)
    assert buffered_swiglu(x, counts, w1, w2, w3, bound=8).shape == (8, 16)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the loop does read it
        grouped_swiglu(x.float(), counts, w1.float(), w2.float(), w3.float())
