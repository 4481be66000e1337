"""The chunked cross-entropy equals ``F.cross_entropy`` on fp32 logits: loss and gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from forge.config.sections import ModelConfig
from forge.data.loader import Batch
from forge.data.packing import IGNORE_INDEX, pack
from forge.model.chunked_loss import token_loss_terms
from forge.model.transformer import Transformer
from forge.training.step import lm_loss_and_z

N, D, V = 37, 16, 101  # N not a multiple of any chunk size below


def reference_terms(hidden, weight, labels):
    logits = (hidden @ weight.t()).float()
    ce = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return ce, logits.logsumexp(-1)


def inputs(ignored: int = 0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, N, D, generator=gen, dtype=torch.float64).float()
    weight = torch.randn(V, D, generator=gen) * 0.5
    labels = torch.randint(0, V, (1, N), generator=gen)
    labels[0, :ignored] = IGNORE_INDEX
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def objective(ce, lse, labels, z_weight):
    mask = labels != IGNORE_INDEX
    n = mask.sum()
    return ce.sum() / n + z_weight * (lse.square() * mask).sum() / n


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
    ce, lse = token_loss_terms(h1, w1, labels, chunk)
    ref_ce, ref_lse = reference_terms(h2, w2, labels)
    torch.testing.assert_close(ce, ref_ce, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    assert (ce[labels == IGNORE_INDEX] == 0).all()
    objective(ce, lse, labels, z_weight).backward()
    objective(ref_ce, ref_lse, labels, z_weight).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-6, rtol=1e-6)


def test_chunked_loss_in_bf16_autocast_matches_the_plain_autocast_loss():
    """Under autocast the chunks project in bf16 like an autocast ``nn.Linear``; the loss is
    still an fp32 logsumexp of those bf16 logits."""
    h1, w1, labels = inputs()
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, _ = token_loss_terms(h1, w1, labels, 8)
        logits = F.linear(h2, w2)
    assert logits.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
    torch.testing.assert_close(ce, ref, atol=1e-5, rtol=1e-5)
    ce.mean().backward()
    ref.mean().backward()
    assert w1.grad is not None and w1.grad.dtype == torch.float32
    torch.testing.assert_close(w1.grad, w2.grad, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(h1.grad, h2.grad, atol=2e-3, rtol=2e-2)


def test_a_bf16_weight_gets_a_bf16_gradient():
    """Pure bf16 parameters: the gradient has the parameter's dtype (summed in fp32)."""
    h, w, labels = inputs()
    h = h.detach().bfloat16().requires_grad_()
    w = w.detach().bfloat16().requires_grad_()
    ce, _ = token_loss_terms(h, w, labels, 8)
    ce.mean().backward()
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
def test_model_loss_chunked_equals_plain_with_gradients(packed):
    """The whole model: ``lm_loss_and_z`` chunked vs plain, same loss, z and gradients."""
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
        loss, z = lm_loss_and_z(model, batch, contextlib.nullcontext, None, chunk)
        assert z is not None
        (loss + 1e-2 * z).backward()
        results.append((loss, z, {n: p.grad for n, p in model.named_parameters()}))
    (l1, z1, g1), (l2, z2, g2) = results
    torch.testing.assert_close(l2, l1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(z2, z1, atol=1e-6, rtol=1e-6)
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
        ce, _ = token_loss_terms(h, w, labels, chunk)
        ce.sum().backward()
    assert max(sizes) == max(chunk * V, V * D)
    assert max(sizes) < N * V
