"""Cross-entropy through the output projection, chunk by chunk over tokens.

The plain loss materialises the ``(tokens, vocab)`` logits, upcasts them to fp32 and keeps
them for backward: at vocab 128k and 8k tokens per micro-batch that is 4 GiB for one tensor.
``ChunkedLMLoss`` computes the projection, the fp32 logsumexp and the gradient for
``chunk_size`` tokens at a time: the loss needs ``O(chunk_size × vocab)`` memory beyond the
gradients of its two inputs.

Under tensor parallelism the output weight is split over the vocabulary (vocab-parallel): each
rank projects onto its slice, the logsumexp and the target's logit are combined over the TP
group with two all-reduces per chunk, and the hidden states' gradient is a partial sum that
the caller's DTensor reduces.

Between its matmuls a chunk's work is elementwise passes over ``chunk × vocab`` values (its
fp32 logits, their max, exp and sum, the scaled gradient in the compute dtype), bound by
memory traffic. Eager on a CPU without TP they run ``CPU_ROWS_PER_PASS`` rows at a time, so
that each pass reads what the previous one left in the cache; on a CPU a bf16 gradient of the
output weight joins its fp32 sum in blocks (``chunk_plan``). Both give the bits of whole
chunks: every step of the tail is per row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Partial, Replicate

from forge.config.sections import JobConfig
from forge.data.packing import IGNORE_INDEX
from forge.model.chunk_blocks import (
    ChunkBuffers,
    add_block,
    add_into,
    chunk_buffers,
    chunk_plan,
    row_blocks,
    sum_start,
)


@attrs.frozen
class LossSpec:
    """How the language-model loss is computed: ``chunk_size`` tokens at a time (0: the plain
    loss on the full fp32 logits), with ``z_weight`` × mean logsumexp² in the objective, and
    each chunk through ``torch.compile`` when ``compiled``. A mixture-of-experts model adds
    ``moe_aux_weight`` × its balancing losses and ``moe_z_weight`` × its router z-losses, a
    model with multi-token depths ``mtp_weight`` × their mean loss."""

    chunk_size: int = 0
    z_weight: float = 0.0
    compiled: bool = False
    moe_aux_weight: float = 0.0
    moe_z_weight: float = 0.0
    mtp_weight: float = 0.0  # the multi-token depths' mean loss × this joins the objective

    @property
    def chunked(self) -> bool:
        return self.chunk_size > 0


PLAIN_LOSS = LossSpec()  # the full fp32 logits, then F.cross_entropy


def loss_spec_of(config: JobConfig, compiled: bool = False) -> LossSpec:
    """The loss a run's config asks for: chunked by ``train.loss_chunk_size``, with the
    z-loss weight, each chunk compiled when the model is; a mixture-of-experts model's
    auxiliary-loss weights."""
    train, model = config.train, config.model
    aux, z = (model.moe_aux_loss_weight, model.moe_z_loss_weight) if model.moe else (0.0, 0.0)
    mtp = train.mtp_loss_weight if model.mtp_depth > 0 else 0.0
    return LossSpec(train.loss_chunk_size, train.z_loss_weight, compiled, aux, z, mtp)


def compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The matmul dtype: autocast's when it is on, else the tensors' own."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


class ChunkTerms(NamedTuple):
    """One chunk's contribution: each token's cross-entropy, the sum of its squared
    logsumexps, and (when gradients are wanted) the gradients of its hidden states and of the
    output weight. (A NamedTuple, not attrs: ``torch.compile`` traces building it.) With
    ``ChunkBuffers``, ``grad_weight`` is their tensor: the next chunk overwrites it."""

    ce: torch.Tensor
    z_sum: torch.Tensor
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None


def row_terms(
    logits: torch.Tensor,  # (R, V_local), in the compute dtype
    index: torch.Tensor,
    owned: torch.Tensor,
    valid: torch.Tensor,
    count: torch.Tensor,
    z_weight: float,
    group: ProcessGroup | None,
    grad_out: torch.Tensor | None,  # (R, V_local), the compute dtype; fp32: ``logits`` itself
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy and logsumexp, in fp32; with ``grad_out``, the objective's
    gradient with respect to the rows' logits written into it. Every step is per row."""
    logits = logits.float()  # in place when the compute dtype is fp32
    peak = logits.amax(-1)
    if group is not None and not logits.is_meta:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    picked = logits.gather(-1, index[:, None]).squeeze(-1)
    exp = logits.sub_(peak[:, None]).exp_()  # the logits are not needed again
    sums = torch.stack([exp.sum(-1), torch.where(owned, picked, 0.0)])
    if group is not None and not logits.is_meta:  # combine the vocab slices
        dist.all_reduce(sums, group=group)
    lse = peak + sums[0].log()
    ce = torch.where(valid, lse - sums[1], 0.0)
    if grad_out is not None:
        # d ce / d logits = softmax - onehot(target); d lse² / d logits = 2 lse softmax
        g_ce = valid / count
        g_lse = 2 * z_weight * lse * g_ce
        d_logits = exp.mul_(((g_ce + g_lse) / sums[0])[:, None])  # softmax × scale
        d_logits.scatter_add_(-1, index[:, None], -torch.where(owned, g_ce, 0.0)[:, None])
        if grad_out.dtype != d_logits.dtype:  # fp32 logits are their own gradient's storage
            grad_out.copy_(d_logits)
    return ce, lse


def chunk_terms(
    h: torch.Tensor,  # (C, D), in the compute dtype
    w: torch.Tensor,  # (V_local, D), in the compute dtype
    index: torch.Tensor,  # (C,) the target's row in ``w`` (0 where not owned)
    owned: torch.Tensor,  # (C,) this rank holds the target's row
    valid: torch.Tensor,  # (C,) the label is not ignored
    count: torch.Tensor,  # () unignored labels in the whole micro-batch
    z_weight: float,
    with_grad: bool,
    group: ProcessGroup | None,
    rows_per_pass: int = 0,  # the tail's rows at a time; 0: all at once
    buffers: ChunkBuffers | None = None,  # written instead of new tensors
) -> ChunkTerms:
    """Project one chunk, take its fp32 logsumexp and, with ``with_grad``, the gradients of
    ``mean CE + z_weight × mean lse²`` with respect to ``h`` and ``w``."""
    n = h.shape[0]
    if buffers is not None:
        logits = torch.mm(h, w.t(), out=buffers.logits[:n])
    elif rows_per_pass:
        logits = h @ w.t()
    else:  # the whole chunk at once: its compute-dtype logits freed as soon as converted
        logits = (h @ w.t()).float()
    grad = None
    if with_grad and logits.dtype == torch.float32:
        grad = logits  # becomes its own gradient, in place
    elif with_grad:
        grad = (
            torch.empty_like(logits)
            if buffers is None or buffers.grad is None
            else buffers.grad[:n]
        )
    blocks = row_blocks(n, rows_per_pass or n)
    if len(blocks) == 1:  # no views: a compiled graph copies a mutated view back into its base
        ce, lse = row_terms(logits, index, owned, valid, count, z_weight, group, grad)
    else:
        parts = [
            row_terms(
                logits[p],
                index[p],
                owned[p],
                valid[p],
                count,
                z_weight,
                group,
                None if grad is None else grad[p],
            )
            for p in blocks
        ]
        ce, lse = (torch.cat(t) for t in zip(*parts, strict=True))
    z_sum = (lse.square() * valid).sum()
    if grad is None:
        return ChunkTerms(ce, z_sum, None, None)
    grad = grad.to(h.dtype)  # the whole chunk's fp32 gradient; else already in h's dtype
    if buffers is None:
        return ChunkTerms(ce, z_sum, grad @ w, grad.t() @ h)
    return ChunkTerms(ce, z_sum, grad @ w, torch.mm(grad.t(), h, out=buffers.grad_weight))


@functools.cache
def compiled_chunk_terms() -> Callable[..., ChunkTerms]:
    """``chunk_terms`` through ``torch.compile``: the elementwise tail fused into a few loops
    (built once per process, on first use)."""
    return torch.compile(chunk_terms, dynamic=False)


class ChunkedLMLoss(torch.autograd.Function):
    """The mean cross-entropy (plus ``z_weight`` × the mean squared logsumexp) over the
    unignored tokens of ``hidden @ weight.T``, ``chunk_size`` tokens at a time.

    Each chunk's gradient is computed in forward, while its logits are at hand (the loss's
    gradient with respect to the logits needs nothing from later layers), so backward only
    scales it: no logits are recomputed, and the loss costs the three matmuls of a plain
    linear layer. ``weight`` may be this rank's vocab slice starting at ``vocab_start``; the
    slices' logsumexps and target logits are combined over ``group`` chunk by chunk.
    ``compiled`` runs each chunk through ``compiled_chunk_terms`` (single rank only).

    Returns the objective (differentiable), each token's cross-entropy and the mean squared
    logsumexp (both for logging).
    """

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
        z_weight: float,
        with_grad: bool,
        compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, v_local = hidden.shape[0], weight.shape[0]
        device = hidden.device
        valid = labels != IGNORE_INDEX
        # no label at all (a fully masked micro-batch, a depth with no target): the sums are
        # 0 and stay 0, as the plain loss's, instead of 0 / 0
        count = valid.sum().float().clamp(min=1)
        local = labels - vocab_start
        owned = (local >= 0) & (local < v_local)  # ignored labels are owned by no rank
        index = torch.where(owned, local, 0)
        ce = torch.zeros(n, dtype=torch.float32, device=device)
        z_sum = torch.zeros((), dtype=torch.float32, device=device)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight: torch.Tensor | None = None  # summed over chunks in fp32
        w = weight.to(dtype)
        terms_of = compiled_chunk_terms() if compiled and group is None else chunk_terms
        plan = chunk_plan(device.type, group is not None, compiled, with_grad, dtype, n, chunk_size)
        buffers = chunk_buffers(min(chunk_size, n), weight, dtype) if plan.buffers else None
        block = add_block(weight, plan.add_bytes) if plan.add_bytes else None
        with torch.autocast(device.type, enabled=False):
            for start in range(0, n, chunk_size):
                part = slice(start, min(start + chunk_size, n))
                h = hidden[part].to(dtype)
                terms = terms_of(
                    h,
                    w,
                    index[part],
                    owned[part],
                    valid[part],
                    count,
                    z_weight,
                    with_grad,
                    group,
                    rows_per_pass=plan.rows_per_pass,
                    buffers=buffers,
                )
                ce[part] = terms.ce
                z_sum += terms.z_sum
                if grad_hidden is not None and terms.grad_hidden is not None:
                    grad_hidden[part] = terms.grad_hidden
                if terms.grad_weight is None:
                    continue
                if grad_weight is None:  # a new tensor: the chunk's may be a buffer
                    grad_weight = sum_start(terms.grad_weight, block)
                else:
                    add_into(grad_weight, terms.grad_weight, block)
        z = z_sum / count
        objective = ce.sum() / count + z_weight * z
        if with_grad:
            if grad_weight is None:  # no tokens, no chunk
                grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device)
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(ce, z)
        return objective, ce, z

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        grad_objective = grads[0]  # the other two outputs are for logging only
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_objective is None:
            return (None,) * 10
        scale = grad_objective.to(grad_hidden.dtype)
        return (
            grad_hidden * scale if ctx.needs_input_grad[0] else None,
            grad_weight * scale.to(grad_weight.dtype) if ctx.needs_input_grad[1] else None,
            *(None,) * 8,
        )


def vocab_start_of(weight: DTensor) -> int:
    """The first vocabulary row this rank holds of a weight sharded on dim 0 over a 1-D mesh
    (``torch.chunk``'s split: every rank but the last holds ``ceil(V / n)`` rows)."""
    mesh = weight.device_mesh
    per_rank = -(-weight.shape[0] // mesh.size())
    return min(mesh.get_local_rank() * per_rank, weight.shape[0])


def chunked_lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ChunkedLMLoss`` of the logits ``hidden @ weight.T``: the objective (mean CE +
    ``spec.z_weight`` × mean logsumexp²), each token's CE (``labels.shape``, 0 where ignored)
    and the z term, without materialising the logits.

    ``hidden`` is ``(B, T, D)``; under TP it is a sequence-sharded DTensor and ``weight`` a
    vocab-sharded one, and the results are the same on every TP rank.
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
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    flat = hidden.reshape(-1, hidden.shape[-1])
    objective, ce, z = ChunkedLMLoss.apply(
        flat,
        weight,
        labels.reshape(-1),
        spec.chunk_size,
        dtype,
        vocab_start,
        group,
        spec.z_weight,
        with_grad,
        spec.compiled,
    )  # type: ignore[misc]
    return objective, ce.view(labels.shape), z
