"""Pipeline parallelism with ``torch.distributed.pipelining``: this rank's stage modules, the
module that holds their parameters under the full model's names, tied embeddings across
stages. The decisions (split, layout, what a schedule needs) are pure, in
``forge.parallel.stages``; the schedules themselves in ``forge.parallel.schedules``."""

from __future__ import annotations

import collections
import copy
import datetime
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from forge.config.sections import DistributedConfig
from forge.model.chunked_loss import LossSpec
from forge.model.transformer import Transformer
from forge.parallel.stages import (
    balanced_boundaries,
    layer_costs,
    local_stages,
    stage_layers,
)


def count(module: nn.Module | None) -> int:
    """The parameters of ``module`` (0 for None), on the meta device too."""
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def stage_boundaries(model: Transformer, cfg: DistributedConfig) -> tuple[int, ...]:
    """Where each stage after the first begins: ``pp_stage_boundaries`` when given, else the
    split balanced by parameter count, the embedding counted on the first stage and the final
    norm and head on the last (``balanced_boundaries``)."""
    if cfg.pp_stage_boundaries:
        return cfg.pp_stage_boundaries
    layers = [count(block) for block in model.layers.values()]
    # a tied head still costs its stage a copy; multi-token depths sit with the head
    head = count(model.norm) + count(model.output) + count(model.mtp)
    costs = layer_costs(layers, count(model.tok_embeddings), head)
    return balanced_boundaries(costs, cfg.n_stages)


def stage_module(model: Transformer, layers: range, first: bool, last: bool) -> Transformer:
    """A copy of ``model`` holding only ``layers`` (global names kept); the embedding lives on
    the ``first`` stage, the final norm, head and multi-token depths on the ``last``, which
    keeps a copy of the embedding for its depths (``tied_weight`` keeps the two alike)."""
    keep = {str(i) for i in layers}
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if not first:
        part.embeds_tokens = False
        if not (last and part.mtp is not None):
            part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
        part.mtp = None
    return part


def rank_stage_modules(
    model: Transformer, cfg: DistributedConfig, pp_rank: int
) -> list[Transformer]:
    """The stage modules pipeline rank ``pp_rank`` holds, in stage order."""
    ranges = stage_layers(stage_boundaries(model, cfg), model.cfg.n_layers)
    last = cfg.n_stages - 1
    stages = local_stages(cfg.pp_schedule, cfg.pp, cfg.pp_stages_per_rank, pp_rank)
    return [stage_module(model, ranges[s], s == 0, s == last) for s in stages]


class HeldEmbedding(nn.Module):
    """A tied embedding's weight where the stage holds only the head: registered under the
    embedding's name, so this rank's parameter names, initial values, optimizer groups and
    checkpoint keys are the full tied model's. Its forward passes the hidden states through
    (a later stage gets no token ids)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def first_of(modules: Iterable[nn.Module | None]) -> nn.Module | None:
    """The first of ``modules`` that is not None."""
    return next((m for m in modules if m is not None), None)


class RankStages(Transformer):
    """The parameters of a rank's several stage modules under the full model's names: what
    the optimizer, the checkpoints, initialisation and the freeze schedule see (a state dict
    is the union of the stages'). It shares the stages' submodules and is never run: the
    schedule runs each stage module."""

    def __init__(self, stages: Sequence[Transformer]) -> None:
        nn.Module.__init__(self)  # no layers of its own: the stages' are registered below
        self.cfg = stages[0].cfg
        layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})
        # add_module registers a missing part too (as None), so a tied head's
        # ``HeldEmbedding`` can take the embedding's place, first in the names
        self.add_module("tok_embeddings", first_of(s.tok_embeddings for s in stages))
        self.add_module("layers", layers)
        self.add_module("norm", first_of(s.norm for s in stages))
        self.add_module("output", first_of(s.output for s in stages))
        self.add_module("mtp", first_of(s.mtp for s in stages))
        self.register_buffer("rope_cos", stages[0].rope_cos, persistent=False)
        self.register_buffer("rope_sin", stages[0].rope_sin, persistent=False)
        self.stages = tuple(stages)  # a tuple: not registered, the names stay global

    def train(self, mode: bool = True) -> RankStages:
        """Training or evaluation mode on this module and on each stage module the schedule
        runs (the stages are not its children; their forward reads the mode)."""
        super().train(mode)
        for stage in self.stages:
            stage.train(mode)
        return self

    def register_forward_hook(self, hook: Any, *args: Any, **kwargs: Any) -> RemovableHandle:
        """The hook on every stage module, as this module's forward never runs (a ``nan``
        fault, ``forge.resilience.faults``, then reaches the rank's stages)."""
        return StageHandles([s.register_forward_hook(hook, *args, **kwargs) for s in self.stages])


class StageHandles(RemovableHandle):
    """One handle for a hook on each of several modules."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        super().__init__(collections.OrderedDict())
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def rank_model(stages: Sequence[Transformer]) -> Transformer:
    """The module that holds this rank's parameters (``RankStages``, or the one stage
    itself), after the stages are materialized. A tied embedding is one weight where the
    first and the last stage share the rank (V layout); where the rank holds only the last
    stage, the head's weight is also registered as the embedding (``HeldEmbedding``)."""
    first = next((s for s in stages if s.embeds_tokens), None)
    last = next((s for s in stages if s.output is not None), None)
    tied = stages[0].cfg.tie_embeddings
    if first is not None and last is not None and first.tok_embeddings is not None:
        if tied:
            assert last.output is not None
            last.output.weight = first.tok_embeddings.weight
        if last is not first and last.tok_embeddings is not None:  # the depths' copy
            last.tok_embeddings.weight = first.tok_embeddings.weight
    model = stages[0] if len(stages) == 1 else RankStages(stages)
    # a last stage with multi-token depths holds its embedding's copy, tied to its head
    held = first is None and last is not None and last.tok_embeddings is None
    if tied and held and last is not None and last.output is not None:
        model.add_module("tok_embeddings", HeldEmbedding(last.output.weight))
    return model


@attrs.frozen
class TiedWeight:
    """This rank's end of an embedding tied across pipeline ranks: the first stage's
    embedding or the last stage's head, and the group of the two ranks that hold them. Their
    gradients are summed after backward (as Megatron does), so both copies take the same
    update; the norm counts the weight once (``in_norm`` on the first stage's end)."""

    weight: torch.Tensor
    group: ProcessGroup
    in_norm: bool

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Add the other end's gradient to this one's (both ends call it)."""
        w = self.weight
        if not w.requires_grad:  # frozen: both ends alike (one name, one freeze rule)
            return
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        grad = w.grad
        if isinstance(grad, DTensor) and isinstance(w, DTensor) and grad.placements != w.placements:
            # TP's embedding leaves a replicated gradient of its vocab-sharded weight: both ends
            # must add the same shard
            grad = w.grad = grad.redistribute(w.device_mesh, w.placements)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        torch_dist.all_reduce(local, group=self.group)


def end_pairs(mesh: DeviceMesh, last_rank: int) -> list[list[int]]:
    """For every data/tensor-parallel coordinate, the global ranks of pipeline rank 0 and
    pipeline rank ``last_rank`` (the two ends of a tied embedding)."""
    names = mesh.mesh_dim_names or ()
    ranks = mesh.mesh.movedim(names.index("pp"), 0)
    pp = ranks.shape[0]
    ranks = ranks.reshape(pp, -1)
    return [[int(a), int(b)] for a, b in zip(ranks[0], ranks[last_rank], strict=True)]


def tied_weight(
    stages: Sequence[Transformer],
    mesh: DeviceMesh,
    pp_group: ProcessGroup,
    pp_rank: int,
    last_rank: int,
    timeout_s: float,
) -> TiedWeight | None:
    """This rank's ``TiedWeight`` when the embedding is also needed on the last stage (tied
    to the head, or embedding the tokens of multi-token depths) and its two ends lie on
    different pipeline ranks (pipeline rank 0, whose first stage holds the embedding, and
    ``last_rank``, whose last stage holds the head or the depths' copy); None elsewhere.
    Every rank takes part in creating the groups of every pair, each bounded by
    ``timeout_s`` (``distributed.timeout_s``), as the mesh's own groups are."""
    cfg = stages[0].cfg
    if not (cfg.tie_embeddings or cfg.mtp_depth > 0) or last_rank == 0:
        return None
    group = pp_group  # at pp = 2 the two ends are the whole pipeline group
    if torch_dist.get_world_size(pp_group) > 2:
        me = torch_dist.get_rank()
        for pair in end_pairs(mesh, last_rank):  # every rank creates every group, in order
            made = torch_dist.new_group(pair, timeout=datetime.timedelta(seconds=timeout_s))
            if me in pair:
                assert isinstance(made, ProcessGroup)
                group = made
    embedding = stages[0].tok_embeddings if stages[0].embeds_tokens else None  # stage order
    if pp_rank == 0 and embedding is not None:
        return TiedWeight(embedding.weight, group, in_norm=True)
    copy_ = stages[-1].output if cfg.tie_embeddings else stages[-1].tok_embeddings
    if pp_rank == last_rank and copy_ is not None:
        return TiedWeight(copy_.weight, group, in_norm=False)
    return None


def head_kwargs(
    labels: torch.Tensor, loss: LossSpec, tokens: torch.Tensor | None = None
) -> dict[str, object]:
    """The last stage's keyword inputs (the schedule splits them with the micro-batches): with
    a chunked loss the stage computes the loss from ``labels`` itself; a model with
    multi-token depths also takes the row's ``tokens`` for them, and the labels."""
    kwargs: dict[str, object] = {}
    if loss.chunked:
        kwargs |= {"labels": labels, "loss": loss}
    if tokens is not None:
        kwargs |= {"labels": labels, "depth_tokens": tokens}
    return kwargs
