"""The chunked cross-entropy equals ``F.cross_entropy`` on fp32 logits: loss and gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import forge.model.chunk_blocks as chunk_blocks
from forge.config.sections import ModelConfig
from forge.data.batch import Batch
from forge.data.packing import IGNORE_INDEX, pack
from forge.model.chunk_blocks import add_into, sum_start
from forge.model.chunked_loss import LossSpec, chunked_lm_loss
from forge.model.transformer import Transformer
from forge.training.steps.common import micro_batch_loss

N, D, V = 37, 16, 101  # N not a multiple of any chunk size below


def reference_terms(hidden, weight, labels):
    logits = (hidden @ weight.t()).float()
    ce = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return ce, logits.logsumexp(-1)


def inputs(ignored: int = 0, seed: int = 0, n: int = N, v: int = V):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, n, D, generator=gen, dtype=torch.float64).float()
    weight = torch.randn(v, D, generator=gen) * 0.5
    labels = torch.randint(0, v, (1, n), generator=gen)
    labels[0, :ignored] = IGNORE_INDEX
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def reference_objective(hidden, weight, labels, z_weight):
    ce, lse = reference_terms(hidden, weight, labels)
    mask = labels != IGNORE_INDEX
    n = mask.sum()
    z = (lse.square() * mask).sum() / n
    return ce.sum() / n + z_weight * z, ce, z


@pytest.mark.parametrize(
    ("chunk", "ignored", "z_weight"),
    [
        (1, 0, 0.0),  # one token at a time
        (8, 0, 0.0),  # a last chunk shorter than the others
        (37, 0, 0.0),  # one chunk: all tokens
        (4096, 0, 0.0),  # chunk larger than the batch
        (8, 11, 0.0),  # ignored labels: no loss, no gradient through them
        (8, 0, 1e-2),  # z-loss: the logsumexp's own gradient
        (5, 9, 1e-1),  # both
    ],
)
def test_chunked_loss_and_gradients_equal_cross_entropy_on_fp32_logits(chunk, ignored, z_weight):
    h1, w1, labels = inputs(ignored)
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    objective, ce, z = chunked_lm_loss(h1, w1, labels, LossSpec(chunk, z_weight))
    ref_objective, ref_ce, ref_z = reference_objective(h2, w2, labels, z_weight)
    torch.testing.assert_close(objective, ref_objective, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(z, ref_z.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ce, ref_ce, atol=1e-6, rtol=1e-6)
    assert (ce[labels == IGNORE_INDEX] == 0).all()
    (3 * objective).backward()  # backward scales the gradient computed in forward
    (3 * ref_objective).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-6, rtol=1e-6)


def test_a_confidently_wrong_token_has_a_large_finite_loss():
    """A target whose probability underflows fp32 (logit 200 below the top one) still has
    the loss ``F.cross_entropy`` gives it, not inf."""
    hidden = torch.tensor([[[1.0, 0.0]]])
    weight = torch.tensor([[200.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([[1]])
    _, ce, _ = chunked_lm_loss(hidden, weight, labels, LossSpec(4))
    expected = F.cross_entropy((hidden @ weight.t())[0], labels[0])
    assert torch.isfinite(ce).all()
    torch.testing.assert_close(ce[0, 0], expected)


def test_without_gradients_no_gradient_is_computed():
    """Eval runs under ``no_grad``: the loss is the same and nothing is kept for backward."""
    h, w, labels = inputs()
    with torch.no_grad():
        objective, ce, _ = chunked_lm_loss(h, w, labels, LossSpec(8))
    assert objective.grad_fn is None
    torch.testing.assert_close(ce, reference_terms(h, w, labels)[0].detach(), atol=1e-6, rtol=1e-6)


def test_chunked_loss_in_bf16_autocast_matches_the_plain_autocast_loss():
    """Under autocast the chunks project in bf16 like an autocast ``nn.Linear``; the loss is
    still an fp32 logsumexp of those bf16 logits."""
    h1, w1, labels = inputs()
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        objective, ce, _ = chunked_lm_loss(h1, w1, labels, LossSpec(8))
        logits = F.linear(h2, w2)
    assert logits.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
    torch.testing.assert_close(ce, ref, atol=1e-5, rtol=1e-5)
    objective.backward()
    ref.mean().backward()
    assert w1.grad is not None and w1.grad.dtype == torch.float32
    torch.testing.assert_close(w1.grad, w2.grad, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(h1.grad, h2.grad, atol=2e-3, rtol=2e-2)


def test_a_bf16_weight_gets_a_bf16_gradient():
    """Pure bf16 parameters: the gradient has the parameter's dtype (summed in fp32)."""
    h, w, labels = inputs()
    h = h.detach().bfloat16().requires_grad_()
    w = w.detach().bfloat16().requires_grad_()
    chunked_lm_loss(h, w, labels, LossSpec(8))[0].backward()
    assert w.grad is not None and w.grad.dtype == torch.bfloat16
    assert h.grad is not None and h.grad.dtype == torch.bfloat16


CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=32)


def packed_batch(seed: int = 0) -> Batch:
    """Two rows of several documents each (BOS = 1), packed as the loader packs them."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, CFG.vocab_size, (2, 33), generator=gen)
    tokens[0, [0, 11]] = 1
    tokens[1, [6, 26]] = 1  # row 1 starts inside a document
    p = pack(tokens, bos_id=1)
    assert (p.labels == IGNORE_INDEX).any()
    return Batch(p.inputs, p.labels, positions=p.positions, document_ids=p.document_ids)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("z_weight", [0.0, 1e-2])
def test_model_loss_chunked_equals_plain_with_gradients(packed, z_weight):
    """The whole model: ``micro_batch_loss`` chunked vs plain, same loss, z and gradients."""
    torch.manual_seed(0)
    plain = Transformer(CFG)
    chunked = Transformer(CFG)
    chunked.load_state_dict(plain.state_dict())
    batch = (
        packed_batch()
        if packed
        else Batch(inputs=torch.randint(0, 259, (2, 32)), labels=torch.randint(0, 259, (2, 32)))
    )
    results = []
    for model, chunk in ((plain, 0), (chunked, 7)):
        terms = micro_batch_loss(
            model, batch, contextlib.nullcontext, loss_spec=LossSpec(chunk, z_weight)
        )
        terms.objective.backward()
        results.append((terms, {n: p.grad for n, p in model.named_parameters()}))
    (t1, g1), (t2, g2) = results
    torch.testing.assert_close(t2.objective, t1.objective, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(t2.loss, t1.loss, atol=1e-6, rtol=1e-6)
    assert (t1.z is None) == (t2.z is None) == (z_weight == 0)
    if t1.z is not None:
        torch.testing.assert_close(t2.z, t1.z, atol=1e-6, rtol=1e-6)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=1e-6, msg=name)


def test_chunked_loss_never_materialises_the_full_logits():
    """No tensor of ``tokens × vocab`` elements is created in forward or backward; the largest
    has ``chunk × vocab`` elements."""
    h, w, labels = inputs()
    chunk, sizes = 4, []

    class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    sizes.append(t.numel())
            return out

    with Sizes():
        chunked_lm_loss(h, w, labels, LossSpec(chunk))[0].backward()
    assert max(sizes) == max(chunk * V, V * D)
    assert max(sizes) < N * V


def test_the_compiled_chunk_equals_the_eager_one():
    """``train.compile`` runs each chunk through ``torch.compile``: same loss and gradients."""
    results = []
    for compiled in (False, True):
        h, w, labels = inputs(ignored=9)
        objective, ce, z = chunked_lm_loss(h, w, labels, LossSpec(8, 1e-2, compiled))
        objective.backward()
        results.append((objective, ce, z, h.grad, w.grad))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


def loss_and_grads(
    dtype: torch.dtype,
    ignored: int,
    z_weight: float,
    autocast: bool = False,
    shape: tuple[int, int, int] = (N, V, 8),
):
    """The chunked loss's objective, CE and z, and the gradients of 3 × the objective, with
    ``h`` and ``w`` in ``dtype`` (or fp32 under bf16 autocast); ``shape``: tokens, vocabulary,
    tokens per chunk."""
    n, v, chunk = shape
    h, w, labels = inputs(ignored, n=n, v=v)
    h = h.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        objective, ce, z = chunked_lm_loss(h, w, labels, LossSpec(chunk, z_weight))
    (3 * objective).backward()
    return objective, ce, z, h.grad, w.grad


def whole_chunk_loss_and_grads(
    dtype: torch.dtype,
    ignored: int,
    z_weight: float,
    autocast: bool = False,
    shape: tuple[int, int, int] = (N, V, 8),
):
    """``loss_and_grads`` as forge computed it before its CPU path (d89bca1), written out
    again on its own: each chunk whole, its fp32 logits turned into their gradient in place,
    converted to the compute dtype, the weight's gradient summed in fp32 from zeros."""
    n, v, chunk = shape
    h, w, labels = inputs(ignored, n=n, v=v)
    hidden, weight, labels = h.detach().to(dtype)[0], w.detach().to(dtype), labels[0]
    compute = torch.bfloat16 if autocast else dtype
    valid = labels != IGNORE_INDEX
    count = valid.sum().float()
    index = torch.where(valid, labels, 0)
    ce, z_sum = torch.zeros(n), torch.zeros(())
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros(v, D)
    wc = weight.to(compute)
    for start in range(0, n, chunk):
        part = slice(start, min(start + chunk, n))
        hc = hidden[part].to(compute)
        logits = (hc @ wc.t()).float()
        peak = logits.amax(-1)
        picked = logits.gather(-1, index[part, None]).squeeze(-1)
        exp = logits.sub_(peak[:, None]).exp_()
        sums = torch.stack([exp.sum(-1), torch.where(valid[part], picked, 0.0)])
        lse = peak + sums[0].log()
        ce[part] = torch.where(valid[part], lse - sums[1], 0.0)
        z_sum += (lse.square() * valid[part]).sum()
        g_ce = valid[part] / count
        g_lse = 2 * z_weight * lse * g_ce
        d_logits = exp.mul_(((g_ce + g_lse) / sums[0])[:, None])
        d_logits.scatter_add_(-1, index[part, None], -torch.where(valid[part], g_ce, 0.0)[:, None])
        d_logits = d_logits.to(compute)
        grad_hidden[part] = d_logits @ wc
        grad_weight += d_logits.t() @ hc
    z = z_sum / count
    objective = ce.sum() / count + z_weight * z
    scale = (3 * torch.ones(())).to(dtype)
    return objective, ce[None], z, (grad_hidden * scale)[None], grad_weight.to(dtype) * scale


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: unlike ``torch.equal``, -0.0 differs from +0.0."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


NAMES = ("objective", "ce", "z", "hidden grad", "weight grad")


@pytest.mark.parametrize(
    ("dtype", "autocast"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
)
@pytest.mark.parametrize(
    ("rows_per_pass", "bytes_per_add", "ignored", "z_weight"),
    [
        (0, 0, 0, 0.0),  # whole chunks, one add: the path GPUs, TP and compiled chunks take
        (1, 64, 0, 0.0),  # the fewest rows (blocks of 2: never one row); one weight row per add
        (3, 7 * 64, 0, 0.0),  # blocks that divide neither the chunk nor the vocabulary
        (3, 7 * 64, 11, 1e-2),  # with ignored labels and the z-loss
        (8, 200 * 64, 0, 1e-2),  # one block: the whole chunk, the whole weight
        (32, 8 << 20, 5, 1e-2),  # the defaults: at 8 tokens per chunk, one block
    ],
)
def test_the_loss_is_the_same_bits_as_forge_computed_before_its_cpu_path(
    monkeypatch, dtype, autocast, rows_per_pass, bytes_per_add, ignored, z_weight
):
    """On a CPU the chunk's elementwise tail runs over a few rows at a time and the weight's
    gradient is added block by block (to stay in the cache): every value is per row, so the
    loss and the gradients are the bits of whole chunks, as before (-0.0 included)."""
    monkeypatch.setattr(chunk_blocks, "CPU_ROWS_PER_PASS", rows_per_pass)
    monkeypatch.setattr(chunk_blocks, "CPU_BYTES_PER_ADD", bytes_per_add)
    expected = whole_chunk_loss_and_grads(dtype, ignored, z_weight, autocast)
    got = loss_and_grads(dtype, ignored, z_weight, autocast)
    for name, a, b in zip(NAMES, expected, got, strict=True):
        assert b is not None and a.dtype == b.dtype and torch.equal(bits(a), bits(b)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_pass", [1, 32])
def test_the_loss_at_a_real_vocabulary_is_the_same_bits_as_before(
    monkeypatch, dtype, rows_per_pass
):
    """At vocab 65536 torch sums a long row in parallel pieces when it is alone (another
    order, other bits): 66 tokens in chunks of 33 on 2 threads leave a 33rd row after a
    32-row block, and blocks of 1 row would be alone; neither may be summed alone."""
    monkeypatch.setattr(chunk_blocks, "CPU_ROWS_PER_PASS", rows_per_pass)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        shape = (66, 65536, 33)
        expected = whole_chunk_loss_and_grads(dtype, 3, 1e-2, shape=shape)
        got = loss_and_grads(dtype, 3, 1e-2, shape=shape)
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(NAMES, expected, got, strict=True):
        assert b is not None and torch.equal(bits(a), bits(b)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [0, 1, 2, 4])  # 0: no block
@pytest.mark.parametrize("value", [-0.0, 0.0, 1.5, -3.25, float("inf"), float("-inf")])
def test_a_sum_starts_as_zeros_plus_its_first_part(dtype, block_rows, value):
    part = torch.full((3, 5), value, dtype=dtype)
    block = torch.full((block_rows, 5), 7.0) if block_rows else None
    assert torch.equal(bits(sum_start(part, block)), bits(torch.zeros(3, 5) + part))


@pytest.mark.parametrize(
    ("device", "tp", "compiled", "with_grad", "dtype", "tokens", "plan"),
    [
        # eager on a CPU: row blocks, buffers; the add block for several bf16 chunks
        ("cpu", False, False, True, torch.bfloat16, 2048, (32, True, 8 << 20)),
        ("cpu", False, False, True, torch.float32, 2048, (32, True, 0)),  # fp32: no conversion
        ("cpu", False, False, True, torch.float64, 2048, (32, True, 0)),  # wider: no conversion
        ("cpu", False, False, True, torch.bfloat16, 256, (32, True, 0)),  # one chunk: no sum
        ("cpu", False, False, False, torch.bfloat16, 2048, (32, False, 0)),  # evaluation
        ("cpu", False, False, True, torch.bfloat16, 0, (32, False, 0)),  # no tokens
        # whole chunks: compiled (inductor fuses the passes), under TP, on a GPU
        ("cpu", False, True, True, torch.bfloat16, 2048, (0, False, 8 << 20)),
        ("cpu", True, False, True, torch.bfloat16, 2048, (0, False, 8 << 20)),
        ("cuda", False, False, True, torch.bfloat16, 2048, (0, False, 0)),
        ("cuda", True, True, True, torch.float32, 2048, (0, False, 0)),
    ],
)
def test_the_chunk_plan_blocks_only_eager_cpu_chunks(
    device, tp, compiled, with_grad, dtype, tokens, plan
):
    got = chunk_blocks.chunk_plan(device, tp, compiled, with_grad, dtype, tokens, 256)
    assert (got.rows_per_pass, got.buffers, got.add_bytes) == plan


@pytest.mark.parametrize(
    ("part_dtype", "block_rows"),
    [
        (torch.bfloat16, 1),
        (torch.bfloat16, 7),  # a last block shorter than the others
        (torch.bfloat16, 101),  # one block: the whole tensor
        (torch.bfloat16, 0),  # no block: one add
        (torch.float32, 7),  # same dtype: one add
    ],
)
def test_add_into_is_one_add_of_the_converted_part(part_dtype, block_rows):
    gen = torch.Generator().manual_seed(1)
    total = torch.randn(101, 16, generator=gen)
    part = torch.randn(101, 16, generator=gen).to(part_dtype)
    expected = total + part.float()
    add_into(total, part, torch.full((block_rows, 16), 7.0) if block_rows else None)
    assert torch.equal(bits(total), bits(expected))


@pytest.mark.parametrize(
    ("nbytes", "rows"),
    [(64, 1), (7 * 64, 7), (1, 1), (1 << 30, V)],  # a row is 16 fp32 (64 bytes); at most V
)
def test_the_add_block_holds_whole_rows_within_its_bytes(nbytes, rows):
    assert chunk_blocks.add_block(torch.empty(V, D), nbytes).shape == (rows, D)


def test_no_tokens_give_zero_gradients():
    """An empty micro-batch has no chunk: the weight's gradient is zeros, not missing."""
    h = torch.randn(1, 0, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    objective, ce, _ = chunked_lm_loss(h, w, torch.zeros(1, 0, dtype=torch.long), LossSpec(8))
    objective.backward()
    assert ce.shape == (1, 0)
    assert w.grad is not None and torch.equal(w.grad, torch.zeros(V, D))
    assert h.grad is not None and h.grad.shape == (1, 0, D)


@pytest.mark.parametrize(
    ("n", "rows", "expected"),
    [
        (8, 3, [(0, 3), (3, 6), (6, 8)]),
        (7, 3, [(0, 3), (3, 7)]),  # a lone last row joins the block before it
        (1, 32, [(0, 1)]),  # one row alone is the whole chunk
        (33, 32, [(0, 33)]),
        (5, 1, [(0, 2), (2, 5)]),  # never a block of one row
        (1, 1, [(0, 1)]),
        (64, 32, [(0, 32), (32, 64)]),
    ],
)
def test_row_blocks_never_leave_a_lone_row(n, rows, expected):
    assert [(b.start, b.stop) for b in chunk_blocks.row_blocks(n, rows)] == expected
