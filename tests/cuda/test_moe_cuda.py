"""The experts on a GPU: the padded grouped GEMM and the fixed-capacity buffers equal the
per-expert loop, and neither reads anything back to the host. Skipped without CUDA."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from forge.config.sections import ModelConfig
from forge.model import moe as moe_module
from forge.model.expert_groups import ExpertKernel, buffered_swiglu, padded_grouped_swiglu
from forge.model.moe import MoE, empty_stats, grouped_mm_supported

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COUNTS = [[40, 0, 3, 21], [0, 0, 64, 0], [16, 16, 16, 16], [1, 2, 3, 58]]


def grouped_gemm_device() -> bool:
    """A GPU whose grouped GEMM runs without a host read (Hopper, Blackwell)."""
    x = torch.empty(1, 64, device="cuda", dtype=torch.bfloat16)
    return grouped_mm_supported(x, torch.empty(1, 64, 128, device="cuda", dtype=torch.bfloat16))


def operands(counts: list[int], dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(counts), 64, device="cuda", generator=g).to(dtype).requires_grad_()
    ws = [
        (torch.randn(4, *shape, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_()
        for shape in ((64, 128), (128, 64), (64, 128))
    ]
    return x, torch.tensor(counts, device="cuda"), ws


def loop(x, counts, w1, w2, w3):
    parts = x.split(counts)
    return torch.cat([(F.silu(r @ w1[e]) * (r @ w3[e])) @ w2[e] for e, r in enumerate(parts)])


def check_against_loop(run, counts: list[int], dtype: torch.dtype, tol: float) -> None:
    x, c, ws = operands(counts, dtype)
    out = run(x, c, *ws)
    expected = loop(x, counts, *ws)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *ws], grad)
    want = torch.autograd.grad(expected, [x, *ws], grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("alignment", [8, 16])
@pytest.mark.parametrize("counts", COUNTS)
def test_the_padded_grouped_gemm_equals_the_loop_on_the_gpu(counts, alignment):
    if not grouped_gemm_device():
        pytest.skip("the grouped GEMM's fast path needs compute capability 9.x or 10.x")
    run = lambda *a: padded_grouped_swiglu(*a, alignment=alignment)  # noqa: E731
    check_against_loop(run, counts, torch.bfloat16, tol=2e-2)


@pytest.mark.parametrize("counts", COUNTS)
def test_the_fixed_capacity_buffers_equal_the_loop_on_the_gpu(counts):
    run = lambda *a: buffered_swiglu(*a, bound=64)  # noqa: E731
    check_against_loop(run, counts, torch.float32, tol=1e-3)  # TF32 would be within it too


def test_neither_sync_free_kernel_reads_the_host():
    """``set_sync_debug_mode("error")`` turns any device-to-host wait into an error."""
    x, c, ws = operands([40, 0, 3, 21], torch.bfloat16)
    torch.cuda.synchronize()
    runs = [lambda: buffered_swiglu(x, c, *ws, bound=64)]
    if grouped_gemm_device():
        runs.append(lambda: padded_grouped_swiglu(x, c, *ws, alignment=8))
    torch.cuda.set_sync_debug_mode("error")
    try:
        for run in runs:
            run().float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the check does bite: the loop reads the counts
            moe_module.grouped_swiglu(x.float(), c, *(w.float() for w in ws))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kernel", [ExpertKernel.GROUPED, ExpertKernel.BUFFERED])
def test_a_moe_layer_under_bf16_autocast_equals_the_loop(kernel):
    if kernel is ExpertKernel.GROUPED and not grouped_gemm_device():
        pytest.skip("the grouped GEMM's fast path needs compute capability 9.x or 10.x")
    cfg = ModelConfig(dim=64, n_heads=4, moe_num_experts=4, moe_top_k=2, moe_hidden_dim=128)
    torch.manual_seed(0)
    layer = MoE(cfg, 0).cuda()
    for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
        torch.nn.init.normal_(w, std=0.05)
    x = torch.randn(4, 50, 64, device="cuda")  # 200 tokens: groups of no particular size
    outs = []
    for k in (kernel, ExpertKernel.LOOP):
        with (
            mock.patch.object(moe_module, "expert_kernel", lambda *_, k=k: k),
            torch.autocast("cuda", dtype=torch.bfloat16),
        ):
            out, _ = layer(x, empty_stats(cfg, "cuda"))
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


def test_the_padded_grouped_gemm_compiles_in_one_graph():
    """``fullgraph=True``: no graph break, so no host read, under ``torch.compile``."""
    if not grouped_gemm_device():
        pytest.skip("the grouped GEMM's fast path needs compute capability 9.x or 10.x")
    x, c, ws = operands([40, 0, 3, 21], torch.bfloat16)
    compiled = torch.compile(padded_grouped_swiglu, fullgraph=True)
    out = compiled(x, c, *ws, alignment=8)
    torch.testing.assert_close(out, loop(x, [40, 0, 3, 21], *ws), atol=2e-2, rtol=2e-2)
