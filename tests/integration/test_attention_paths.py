"""Every attention path computes the dense-mask path's function: per-document SDPA exactly
(forward and gradients, fp32, 1e-6), FlexAttention's forward on the CPU, sliding windows; a
packed forward reads the host once, not per layer. CUDA-marked tests: flex and varlen
training against SDPA with the dense mask (run where a GPU is)."""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import attrs
import pytest
import torch
import torch._dynamo
import torch.nn.attention.flex_attention as flex_module
from torch._dynamo.utils import counters

from forge.config import ModelConfig, Precision, SchedulerConfig
from forge.config.model import AttentionBackend
from forge.data.batch import Batch
from forge.errors import UserInputError
from forge.model import attention, transformer
from forge.model.attention import Backend, attend, dense_mask, document_segments
from forge.model.generate import sample
from forge.model.transformer import Transformer
from forge.optim import resolve_schedule
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step
from forge.types import LoopState

# rows of document lengths, each row summing to T = 96
T = 96
LAYOUTS = {
    "one document per row": [[96], [96]],
    "many tiny documents": [[3, 5, 2, 7, 4, 6, 1, 8] * 2 + [2] * 12, [12] * 8],
    "documents of length 1": [[1] * 96, [1, 94, 1]],
    "a document spanning a row beside a packed row": [[96], [40, 30, 26]],
    "either side of the padding threshold": [[63, 33], [64, 32]],
    "long and short": [[80, 1, 15], [2, 2, 92]],
}
HEADS = {"gqa": (4, 2), "mha": (4, 4)}


def ids_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in rows])


def positions_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[p for n in row for p in range(n)] for row in rows])


def qkv(b: int, heads: tuple[int, int], d: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    shapes = [(b, T, h, d), (b, T, hkv, d), (b, T, hkv, d)]  # the model's layout, transposed
    return [
        torch.randn(s, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
        for s in shapes
    ]


def forward_backward(mask, tensors, gqa):
    out = attend(*tensors, mask, gqa)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out, torch.autograd.grad(out, tensors, grad)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_document_sdpa_is_the_dense_mask_function(layout, heads):
    """In float64 the two agree to rounding (1e-12): the same function, not an estimate;
    the fp32 figure is the model-level test's."""
    ids = ids_of(LAYOUTS[layout])
    tensors = qkv(ids.shape[0], HEADS[heads])
    gqa = heads == "gqa"
    out, grads = forward_backward(document_segments(ids), tensors, gqa)
    ref, ref_grads = forward_backward(dense_mask(ids, T, 0, ids.device), tensors, gqa)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=T, vocab_size=64)
EXACT = {"rtol": 1e-6, "atol": 1e-6}  # fp32: a few ulps of another summation order


def packed_inputs(layout: str, seed: int = 0) -> dict[str, torch.Tensor]:
    rows = LAYOUTS[layout]
    tokens = torch.randint(0, 64, (len(rows), T), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tokens, "positions": positions_of(rows), "document_ids": ids_of(rows)}


def model_pass(cfg: ModelConfig, inputs: dict, backend: Backend | None = None):
    """Logits and every parameter's gradient of one forward + backward (``backend`` forces
    the choice: ``DENSE_MASK`` is the reference)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    force = mock.patch.object(transformer, "choose_backend", return_value=backend)
    with force if backend is not None else contextlib.nullcontext():
        logits = model(inputs["tokens"], **{k: v for k, v in inputs.items() if k != "tokens"})
    logits.square().mean().backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


def counting_segment_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = attention.uncompiled_segment_attention()

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "uncompiled_segment_attention", lambda: spy)
    return calls


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_packed_model_on_the_cpu_runs_per_document_and_equals_the_dense_mask(
    monkeypatch, layout, heads
):
    cfg = attrs.evolve(CFG, n_kv_heads=HEADS[heads][1])
    inputs = packed_inputs(layout)
    calls = counting_segment_calls(monkeypatch)
    logits, grads = model_pass(cfg, inputs)
    # auto on a CPU: per document in every layer (rows of one document each: plain causal)
    assert len(calls) == (0 if layout == "one document per row" else cfg.n_layers)
    ref_logits, ref_grads = model_pass(cfg, inputs, Backend.DENSE_MASK)
    torch.testing.assert_close(logits, ref_logits, **EXACT)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **EXACT, msg=name)


HOST_READS = ("cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__")


def count_host_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


def test_a_packed_forward_reads_the_boundaries_once_not_per_layer(monkeypatch):
    model = Transformer(attrs.evolve(CFG, n_layers=4))
    inputs = packed_inputs("many tiny documents")
    reads = count_host_reads(monkeypatch)
    model(inputs.pop("tokens"), **inputs).sum().backward()
    assert reads == ["tolist"]
    reads.clear()
    model(torch.zeros(2, T, dtype=torch.long)).sum().backward()  # unpacked: none at all
    assert reads == []


def test_per_document_attention_compiles_once_for_every_layout():
    torch._dynamo.reset()
    counters.clear()
    model = Transformer(CFG)
    for block in model.layers.values():
        block.compile(backend="eager")  # dynamo's tracing and guards, no C++ compiler needed
    graphs = []
    for layout in ("many tiny documents", "long and short", "documents of length 1"):
        inputs = packed_inputs(layout)
        model(inputs.pop("tokens"), **inputs).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[0] > 0 and graphs[1:] == graphs[:1] * 2  # another layout: no recompile


def naive_mask(ids: torch.Tensor, window: int) -> torch.Tensor:
    """The rule, one pair at a time."""
    b, t = ids.shape
    rule = [
        [[bool(j <= i and ids[r, i] == ids[r, j] and (not window or i - j < window))
          for j in range(t)] for i in range(t)]
        for r in range(b)
    ]  # fmt: skip
    return torch.tensor(rule)[:, None]


@pytest.mark.parametrize("window", [0, 1, 5])
def test_the_dense_mask_is_causal_within_documents_and_the_window(window):
    ids = ids_of([[3, 5, 2, 6], [16]])
    t = ids.shape[1]
    assert torch.equal(dense_mask(ids, t, window, ids.device), naive_mask(ids, window))
    unpacked = dense_mask(None, t, window, ids.device)
    assert torch.equal(unpacked, naive_mask(torch.zeros(1, t, dtype=torch.long), window))


def flex_cfg(**changes) -> ModelConfig:
    return attrs.evolve(CFG, attention=AttentionBackend.FLEX, **changes)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("layout", ["many tiny documents", "long and short", None])
def test_flex_forward_on_the_cpu_equals_the_dense_path(layout, window):
    inputs = (
        packed_inputs(layout) if layout else {"tokens": packed_inputs("long and short")["tokens"]}
    )
    args = {k: v for k, v in inputs.items() if k != "tokens"}
    torch.manual_seed(0)
    flex = Transformer(flex_cfg(sliding_window=window))
    dense = Transformer(attrs.evolve(CFG, sliding_window=window))
    dense.load_state_dict(flex.state_dict())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex warns that it is unfused
        with mock.patch.object(
            flex_module, "flex_attention", wraps=flex_module.flex_attention
        ) as f:
            out = flex(inputs["tokens"], **args)
        assert f.call_count == CFG.n_layers
        with mock.patch.object(transformer, "choose_backend", return_value=Backend.DENSE_MASK):
            ref = dense(inputs["tokens"], **args)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    if window:  # the window changed something: the test would see a path that ignores it
        full = Transformer(CFG)
        full.load_state_dict(flex.state_dict())
        with torch.no_grad():
            assert not torch.allclose(full(inputs["tokens"], **args), ref, atol=1e-3)


def test_flex_refuses_to_train_on_the_cpu_and_varlen_to_run_there():
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(UserInputError, match=r"^model\.attention='flex' cannot train on a CPU"):
        Transformer(flex_cfg())(tokens)
    with pytest.raises(UserInputError, match=r"^model\.attention='varlen' needs a CUDA device"):
        Transformer(attrs.evolve(CFG, attention=AttentionBackend.VARLEN))(tokens)


def test_cached_generation_honours_the_window():
    """Greedy decoding with the KV cache equals recomputing the whole context each token,
    both under a window of 3 keys, and the window changes what is generated."""
    torch.manual_seed(0)
    cfg = attrs.evolve(CFG, sliding_window=3)
    model = Transformer(cfg).eval()
    cached = sample(model, [1, 2, 3, 4, 5], 12, temperature=0, use_cache=True)
    assert cached == sample(model, [1, 2, 3, 4, 5], 12, temperature=0, use_cache=False)
    full = Transformer(CFG).eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        prompt = torch.tensor([cached[:-1]])
        assert not torch.allclose(model(prompt), full(prompt), atol=1e-3)


# --- CUDA: run where a GPU is (pytest -m cuda) ---
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_step(cfg: ModelConfig, layout: str, backend: Backend | None, precision=Precision.FP32):
    """The loss and the weights after one SGD training step (``make_text_step``) on CUDA;
    ``backend`` forces the choice (``DENSE_MASK``: the reference). lr 1: the update is the
    gradient itself."""
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)
    step = make_text_step(StepSpec(model, opt, sched, 1.0, precision))
    inputs = packed_inputs(layout)
    tokens = inputs["tokens"]
    labels = torch.roll(tokens, -1, dims=1)
    batch = Batch(
        tokens, labels, positions=inputs["positions"], document_ids=inputs["document_ids"]
    ).to(torch.device("cuda"))
    force = mock.patch.object(transformer, "choose_backend", return_value=backend)
    with force if backend is not None else contextlib.nullcontext():
        result = step((batch,), LoopState())
    return result.loss, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("layout", ["many tiny documents", "long and short"])
@pytest.mark.parametrize("configured", [AttentionBackend.AUTO, AttentionBackend.FLEX])
def test_flex_training_step_on_cuda_equals_sdpa_with_the_dense_mask(configured, layout, window):
    cfg = attrs.evolve(CFG, attention=configured, sliding_window=window)
    with mock.patch.object(
        flex_module, "create_block_mask", wraps=flex_module.create_block_mask
    ) as m:
        loss, weights = cuda_step(cfg, layout, None)
    assert m.call_count == 1  # auto picks flex on CUDA; one block mask for every layer
    ref_loss, ref_weights = cuda_step(cfg, layout, Backend.DENSE_MASK)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.cuda
@needs_cuda
def test_a_flex_forward_on_cuda_reads_nothing_on_the_host(monkeypatch):
    model = Transformer(CFG).cuda()
    inputs = {k: v.cuda() for k, v in packed_inputs("long and short").items()}
    model(inputs.pop("tokens"), **inputs)  # compile outside the count
    inputs = {k: v.cuda() for k, v in packed_inputs("many tiny documents").items()}
    reads = count_host_reads(monkeypatch)
    model(inputs.pop("tokens"), **inputs).sum().backward()
    assert reads == []


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("window", [0, 9])
def test_varlen_training_step_on_cuda_matches_the_dense_mask_in_bf16(window):
    cfg = attrs.evolve(CFG, attention=AttentionBackend.VARLEN, sliding_window=window)
    loss, weights = cuda_step(cfg, "long and short", None, Precision.BF16)
    ref_loss, ref_weights = cuda_step(cfg, "long and short", Backend.DENSE_MASK, Precision.BF16)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=5e-2, atol=5e-3, msg=name)
