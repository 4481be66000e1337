"""Cross-entropy through the output projection, chunk by chunk over tokens.

The plain loss materialises the ``(tokens, vocab)`` logits, upcasts them to fp32 and keeps
them for backward: at vocab 128k and 8k tokens per micro-batch that is 4 GiB for one tensor.
``ChunkedCrossEntropy`` computes the projection and the logsumexp for ``chunk_size`` tokens at
a time (each chunk in fp32), keeps only the hidden states and one fp32 number per token, and
recomputes each chunk's logits in backward: the loss needs ``O(chunk_size × vocab)`` memory.

Under tensor parallelism the output weight is split over the vocabulary (vocab-parallel): each
rank projects onto its slice, the logsumexp and the target's logit are combined over the TP
group with two all-reduces per micro-batch, and the hidden states' gradient is a partial sum
that the caller's DTensor reduces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Partial, Replicate

from forge.data.packing import IGNORE_INDEX


def compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The matmul dtype: autocast's when it is on, else the tensors' own."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One chunk's logits in fp32, projected in ``dtype`` (as an autocast ``nn.Linear`` does)."""
    return (hidden.to(dtype) @ weight.to(dtype).t()).float()


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy and logsumexp of ``hidden @ weight.T``, ``chunk_size`` tokens
    at a time; ``weight`` may be this rank's vocab slice starting at ``vocab_start``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # (N, D)
        weight: torch.Tensor,  # (V_local, D)
        labels: torch.Tensor,  # (N,), IGNORE_INDEX where no loss
        chunk_size: int,
        dtype: torch.dtype,
        vocab_start: int,
        group: ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, v_local = hidden.shape[0], weight.shape[0]
        local_lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        local = labels - vocab_start
        owned = (local >= 0) & (local < v_local)  # ignored labels are owned by no rank
        index = torch.where(owned, local, 0)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                logits = chunk_logits(hidden[start:end], weight, dtype)
                local_lse[start:end] = logits.logsumexp(-1)
                picked = logits.gather(-1, index[start:end, None]).squeeze(-1)
                target[start:end] = torch.where(owned[start:end], picked, 0.0)
        lse = local_lse
        if group is not None and not hidden.is_meta:  # combine the vocab slices
            peak = local_lse.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([(local_lse - peak).exp(), target])
            dist.all_reduce(sums, group=group)
            lse, target = peak + sums[0].log(), sums[1]
        valid = labels != IGNORE_INDEX
        ce = torch.where(valid, lse - target, 0.0)
        ctx.save_for_backward(hidden, weight, index, owned, valid, lse)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return ce, lse

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        grad_ce, grad_lse = grads  # of the two outputs (None for one that had no gradient)
        hidden, weight, index, owned, valid, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk_size, ctx.dtype
        # an ignored token's ce is the constant 0: no gradient flows through it
        grad_ce = torch.zeros_like(lse) if grad_ce is None else grad_ce.float() * valid
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.float()
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end].to(dtype)
            logits = chunk_logits(h, w, dtype)
            # d ce / d logits = softmax - onehot(target); d lse / d logits = softmax
            probs = (logits - lse[start:end, None]).exp_()
            d_logits = probs.mul_((grad_ce[start:end] + grad_lse[start:end])[:, None])
            hit = torch.where(owned[start:end], grad_ce[start:end], 0.0)
            d_logits.scatter_add_(-1, index[start:end, None], -hit[:, None])
            d_logits = d_logits.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = d_logits @ w
            if want_weight:
                grad_weight += d_logits.t() @ h  # summed over chunks in fp32
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if want_weight else None,
            None,
            None,
            None,
            None,
            None,
        )


def vocab_start_of(weight: DTensor) -> int:
    """The first vocabulary row this rank holds of a weight sharded on dim 0 over a 1-D mesh
    (``torch.chunk``'s split: every rank but the last holds ``ceil(V / n)`` rows)."""
    mesh = weight.device_mesh
    per_rank = -(-weight.shape[0] // mesh.size())
    return min(mesh.get_local_rank() * per_rank, weight.shape[0])


def token_loss_terms(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy (0 where ignored) and logsumexp, both ``labels.shape`` in fp32,
    of the logits ``hidden @ weight.T`` without materialising them.

    ``hidden`` is ``(B, T, D)``; under TP it is a sequence-sharded DTensor and ``weight`` a
    vocab-sharded one, and the result is the same on every TP rank.
    """
    dtype = compute_dtype(hidden.device.type, hidden.dtype)
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        if isinstance(hidden, DTensor):
            # every rank needs every token; the gradient each rank returns covers only its
            # vocab slice, so it is a partial sum over the group
            hidden = hidden.redistribute(placements=[Replicate()]).to_local(
                grad_placements=[Partial()]
            )
        vocab_start = vocab_start_of(weight)
        group = weight.device_mesh.get_group()
        weight = weight.to_local()
    shape = labels.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    ce, lse = ChunkedCrossEntropy.apply(
        flat, weight, labels.reshape(-1), chunk_size, dtype, vocab_start, group
    )  # type: ignore[misc]
    return ce.view(shape), lse.view(shape)
