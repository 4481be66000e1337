"""Mixture-of-experts feed-forward: a router, routed SwiGLU experts computed in groups, shared
experts, and expert parallelism by all-to-all.

A layer's auxiliary losses and counts are *returned* with its output, in one row of the
model's MoE statistics tensor (``MoeStats`` gives the columns): the step adds the losses to
its objective and logs the counts. Nothing is stored on the module during ``forward``; the
only state beside the weights is the sigmoid router's balancing bias, a buffer that
``forge.training.loop.expert_balance`` updates after the optimizer step (and each layer's
constant row selector, a buffer not saved).

Parameter names (checkpoint keys): ``feed_forward.router.gate.weight`` ``(E, dim)``,
``feed_forward.router.expert_bias`` ``(E,)``, ``feed_forward.experts.{w1,w3}`` ``(E, dim,
hidden)``, ``feed_forward.experts.w2`` ``(E, hidden, dim)`` and, with shared experts,
``feed_forward.shared.{w1,w2,w3}.weight`` (one SwiGLU of N × the expert width: N experts that
every token passes through sum to exactly that).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor

from forge.config.model import ModelConfig, MoeRouter
from forge.model.expert_groups import (
    ExpertKernel,
    buffered_swiglu,
    expert_kernel,
    group_alignment,
    padded_grouped_swiglu,
    swiglu,
)
from forge.model.feed_forward import FeedForward

# the columns of one MoE layer's statistics row; the per-expert loads follow them
AUX, Z, DROPPED, ASSIGNED, LOADS = 0, 1, 2, 3, 4


def stats_width(n_experts: int) -> int:
    """Columns of one layer's statistics row: aux, z, dropped, assigned, then the loads."""
    return LOADS + n_experts


class Routing(NamedTuple):
    """Each token's chosen experts ``(N, k)``, their weights ``(N, k)`` (normalised, fp32),
    and the normalised scores over every expert ``(N, E)`` the balancing loss uses."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


def route(
    logits: torch.Tensor,
    top_k: int,
    router: MoeRouter,
    bias: torch.Tensor | None = None,
    groups: tuple[int, int] = (1, 1),
    scale: float = 1.0,
) -> Routing:
    """Choose ``top_k`` experts per token from fp32 router ``logits`` ``(N, E)``.

    softmax: the top-k probabilities, renormalised to sum to 1 (Mixtral). sigmoid: each
    expert scored independently; ``bias`` (aux-loss-free balancing) shifts which experts are
    chosen but not their weights, the chosen scores normalised to sum to 1 (DeepSeek-V3).
    ``groups`` ``(n, top)``: the experts split into ``n`` groups, each scored by its best two
    choice scores, and a token chooses among its ``top`` best groups' experts only
    (``limit_to_groups``). The weights are then multiplied by ``scale``.
    """
    if router is MoeRouter.SOFTMAX:
        probs = logits.softmax(-1)
        top, experts = probs.topk(top_k, dim=-1)
    else:
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias
        if groups != (1, 1):
            choice = limit_to_groups(choice, *groups)
        experts = choice.topk(top_k, dim=-1).indices
        top = scores.gather(-1, experts)
        probs = scores / scores.sum(-1, keepdim=True)
    weights = top / top.sum(-1, keepdim=True)
    return Routing(experts, weights * scale if scale != 1.0 else weights, probs)


def limit_to_groups(choice: torch.Tensor, n_groups: int, top_groups: int) -> torch.Tensor:
    """``choice`` ``(N, E)`` with every expert outside each token's ``top_groups`` best groups
    set to -inf (never chosen, whatever the balancing bias), a group's score being the sum of
    its two best: DeepSeek-V3's rule, as its reference and transformers'
    ``DeepseekV3TopkRouter`` apply it."""
    n, e = choice.shape
    grouped = choice.view(n, n_groups, e // n_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    best = group_scores.topk(top_groups, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, e)


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int | None:
    """Assignments one expert takes per forward: ``ceil(factor × tokens × k / E)``; None
    (dropless) when ``factor`` is 0."""
    if factor <= 0:
        return None
    return math.ceil(factor * n_tokens * top_k / n_experts)


def balance_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The Switch/GShard load-balancing loss ``E × Σ_e f_e × P_e``: ``f_e`` the fraction of
    assignments routed to expert e (not differentiable), ``P_e`` its mean normalised score.
    1.0 when perfectly balanced."""
    n_experts = probs.shape[-1]
    fraction = counts.float() / counts.sum().clamp(min=1)
    return n_experts * (fraction * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The router z-loss (ST-MoE): the mean squared logsumexp of the router logits."""
    return logits.logsumexp(-1).square().mean()


class Assignments(NamedTuple):
    """Token-to-expert assignments sorted by expert: which token each row comes from, its
    routing weight, and how many rows each expert receives ``(E,)``; ``routed`` counts them
    before capacity dropped any."""

    tokens: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor


def sort_by_expert(routing: Routing, n_experts: int, capacity: int | None) -> Assignments:
    """Group the assignments by expert, first choices ahead of second ones (and by token
    within a choice), keeping at most ``capacity`` per expert: the rest are dropped, and the
    token's output lacks that expert's contribution."""
    n, k = routing.experts.shape
    experts = routing.experts.t().reshape(-1)  # choice-major: every first choice first
    tokens = torch.arange(n, device=experts.device).repeat(k)
    weights = routing.weights.t().reshape(-1)
    order = experts.argsort(stable=True)
    sorted_experts = experts[order]
    # each expert's first row: a static shape (bincount's depends on the data: graph breaks)
    bounds = torch.arange(n_experts + 1, device=experts.device, dtype=experts.dtype)
    starts = torch.searchsorted(sorted_experts, bounds)
    routed = counts = starts.diff()
    if capacity is not None:
        position = torch.arange(order.numel(), device=order.device) - starts[sorted_experts]
        order = order[position < capacity]
        counts = routed.clamp(max=capacity)
    return Assignments(tokens[order], weights[order], counts, routed)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands without a host read: 2-D rows
    against a 3-D weight with 16-byte aligned rows, fp32 or bf16 on a CPU (bf16 only under
    ``torch.compile``), bf16 on a Hopper or Blackwell datacenter GPU (compute capability 9.x
    or 10.x: elsewhere torch 2.13 runs it as a loop that reads the offsets on the host)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # its compile-time (fake) kernel takes bf16 only
    aligned = all((size * x.element_size()) % 16 == 0 for size in w.shape[1:])
    if x.device.type == "cpu":
        return aligned and x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(x.device)
        return aligned and x.dtype == torch.bfloat16 and major in (9, 10)
    return False


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    bound: int | None = None,
) -> torch.Tensor:
    """``w2(silu(x w1) * x w3)`` per expert, for rows ``x`` grouped by expert (``counts`` rows
    each, at most ``bound`` per expert when known), by the kernel ``expert_kernel`` picks:
    grouped GEMMs, fixed-capacity buffers, or one matmul per expert on its slice."""
    device, compiling = x.device.type, torch.compiler.is_compiling()
    grouped = grouped_mm_supported(x, w1)
    kernel = expert_kernel(grouped, device, x.shape[0], w1.shape[0], bound, compiling)
    if kernel is ExpertKernel.GROUPED:
        return padded_grouped_swiglu(x, counts, w1, w2, w3, group_alignment(x.dtype, device))
    if kernel is ExpertKernel.BUFFERED:
        assert bound is not None
        return buffered_swiglu(x, counts, w1, w2, w3, bound)
    outs = [  # the split sizes are read on the host: one sync per layer on a GPU
        swiglu(rows @ w1[e], rows @ w3[e]) @ w2[e]
        for e, rows in enumerate(x.split(counts.tolist()))
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


def layer_stats(logits: torch.Tensor, routing: Routing, chosen: Assignments) -> torch.Tensor:
    """One MoE layer's statistics row (``stats_width`` columns): the balancing and z-losses
    (differentiable), the assignments dropped and made, the tokens routed to each expert."""
    counts = torch.stack(
        [
            balance_loss(routing.probs, chosen.routed),
            router_z_loss(logits),
            (chosen.routed - chosen.counts).sum().float(),
            chosen.routed.sum().float(),
        ]
    )
    return torch.cat([counts, chosen.routed.float()])


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by a constant."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would compute a matmul of ``x`` in (``x``'s own outside autocast)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts as three 3-D weights. Under expert parallelism the weights are
    DTensors sharded on dim 0 and each rank computes its own experts."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.grad_scale = 1.0  # set by expert parallelism (see ``apply_ep``)

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, bound: int | None = None
    ) -> torch.Tensor:
        """Rows ``x`` grouped by (local) expert, ``counts`` per expert, each at most ``bound``
        (None: unknown)."""
        dtype = compute_dtype(x)
        weights = []
        for w in (self.w1, self.w2, self.w3):
            local = w.to_local() if isinstance(w, DTensor) else w
            if self.grad_scale != 1.0:
                local = _ScaleGrad.apply(local, self.grad_scale)
            weights.append(local.to(dtype))
        return grouped_swiglu(x.to(dtype), counts, *weights, bound=bound)


class Router(nn.Module):
    """A linear scorer over experts, computed in fp32, with the balancing bias buffer."""

    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.expert_bias: torch.Tensor
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # the bias moves in steps of ~1e-3: it stays fp32 when the model is cast to bf16
        module = super()._apply(fn, recurse)
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``(N, E)`` whatever autocast says."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.gate.weight.float())


class MoE(nn.Module):
    """Routed experts (plus shared ones) in place of a block's SwiGLU.

    ``forward(x, stats)`` returns the output and ``stats`` with this layer's row
    (``layer``-th of the model's MoE layers) filled in; see the module docstring.
    """

    shared: nn.Module | None
    stats_row: torch.Tensor

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        # a tensor, not the int ``layer``: dynamo specialises int attributes, so each MoE block
        # compiled its own graphs and those past its recompile limit (8) ran eager
        self.register_buffer("stats_row", row_selector(layer, len(cfg.moe_layers)), False)
        self.n_experts = cfg.moe_num_experts
        self.top_k = cfg.moe_top_k
        self.router_kind = cfg.moe_router
        self.groups = (cfg.moe_num_groups, cfg.moe_top_groups)
        self.scale = cfg.moe_routed_scale
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = Router(cfg.dim, cfg.moe_num_experts)
        self.experts = GroupedExperts(cfg.moe_num_experts, cfg.dim, cfg.expert_hidden_dim)
        self.shared = None
        if cfg.moe_shared_experts > 0:
            self.shared = FeedForward(cfg.dim, cfg.moe_shared_experts * cfg.expert_hidden_dim)
        self.ep_group: dist.ProcessGroup | None = None  # set by ``apply_ep``
        self.ep_size = 1

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The balancing bias at zero and the row selector again (after ``to_empty``)."""
        self.router.expert_bias.zero_()
        self.stats_row.copy_(row_selector(self.layer, self.stats_row.shape[0]))

    def forward(self, x: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        bias = self.router.expert_bias if self.router_kind is MoeRouter.SIGMOID else None
        routing = route(logits, self.top_k, self.router_kind, bias, self.groups, self.scale)
        capacity = expert_capacity(flat.shape[0], self.top_k, self.n_experts, self.capacity_factor)
        chosen = sort_by_expert(routing, self.n_experts, capacity)
        rows = flat.index_select(0, chosen.tokens)  # (its backward is an index_add)
        if self.ep_group is None:  # a token goes to an expert once: at most all tokens each
            bound = flat.shape[0] if capacity is None else min(capacity, flat.shape[0])
            out = self.experts(rows, chosen.counts, bound)
        else:
            out = self.dispatched(rows, chosen.counts)
        weighted = (out.float() * chosen.weights[:, None]).to(x.dtype)
        y = torch.zeros_like(flat).index_add(0, chosen.tokens, weighted)
        if self.shared is not None:
            y = y + self.shared(flat)
        row = layer_stats(logits, routing, chosen)
        rows = self.stats_row.shape[0]
        torch._check(stats.shape[0] == rows, lambda: f"the MoE statistics need {rows} rows")
        return y.reshape(shape), stats + self.stats_row.to(stats.dtype) * row[None, :]

    def dispatched(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: send each row to the rank holding its expert, compute there,
        and bring the results back in the same order (two all-to-alls each way)."""
        group, ep = self.ep_group, self.ep_size
        assert group is not None
        local = self.n_experts // ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        by_source = received_counts.view(ep, local)  # rows from each rank for each local expert
        send = counts.view(ep, local).sum(1).tolist()
        receive = by_source.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, receive, send, group)
        # arrived is ordered (source rank, expert); the experts want (expert, source rank)
        segment = torch.repeat_interleave(
            torch.arange(ep * local, device=rows.device), by_source.flatten()
        )
        key = (segment % local) * ep + segment // local
        order = key.argsort(stable=True)
        out = self.experts(arrived[order], by_source.sum(0))
        back = torch.empty_like(out).index_copy(0, order, out)
        return all_to_all_single_autograd(back, send, receive, group)


def row_selector(layer: int, n_layers: int) -> torch.Tensor:
    """``(n_layers, 1)``: 1 at MoE layer ``layer``'s row of the statistics, 0 elsewhere."""
    return F.one_hot(torch.tensor(layer), n_layers).float()[:, None]


def empty_stats(cfg: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """The zero statistics a forward pass starts from: one row per MoE layer."""
    return torch.zeros(len(cfg.moe_layers), stats_width(cfg.moe_num_experts), device=device)


class MoeTerms(NamedTuple):
    """The statistics of one forward pass, reduced: the objective's extra term, the mean
    balancing and z losses per layer, the dropped fraction, and the loads ``(layers, E)``."""

    objective: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    dropped_fraction: torch.Tensor
    loads: torch.Tensor


def moe_terms(stats: torch.Tensor, aux_weight: float, z_weight: float) -> MoeTerms:
    """What the step needs from the statistics: ``aux_weight × Σ aux + z_weight × Σ z`` over
    layers (the Switch / ST-MoE convention: each layer adds its own), and the means to log."""
    objective = aux_weight * stats[:, AUX].sum() + z_weight * stats[:, Z].sum()
    dropped = stats[:, DROPPED].sum() / stats[:, ASSIGNED].sum().clamp(min=1)
    return MoeTerms(objective, stats[:, AUX].mean(), stats[:, Z].mean(), dropped, stats[:, LOADS:])


def load_cv(loads: torch.Tensor) -> torch.Tensor:
    """The coefficient of variation (std / mean) of the tokens per expert, averaged over MoE
    layers: 0 when perfectly balanced. ``loads`` ``(layers, E)``."""
    mean = loads.mean(-1)
    std = loads.std(-1, correction=0)
    return (std / mean.clamp(min=1e-9)).mean()
