"""Pipeline stages as pure decisions: how the layers split into stages, which rank holds which
stage, and what each schedule of ``torch.distributed.pipelining`` needs. No torch here, so
every rule has a table test (``tests/unit/test_pipeline_split.py``).

What each schedule needs was measured on torch 2.13 (toy stages, 2 and 4 ranks, gloo):

==========================  ==================  =========================================
schedule                    stages per rank      micro-batches ``n`` per step
==========================  ==================  =========================================
``gpipe``                   1 (one stage)        any ``n >= 1``
``1f1b``                    1 (one stage)        ``n >= pp``
``interleaved_1f1b``        any (a list)         ``n % max(1, n // pp) == 0``
``interleaved_zero_bubble`` any (a list)         ``n % max(1, n // pp) == 0``
``zbv``                     exactly 2, V layout  any ``n >= 1``
``dualpipev``               exactly 2, V layout  ``n >= 2 * pp`` (the stages)
==========================  ==================  =========================================
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from forge.config.sections import PipelineSchedule, Problem

SINGLE_STAGE = frozenset({PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B})
V_SHAPED = frozenset({PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV})
# these run backward in two halves (inputs, then weights), which torch does not support for
# compiled stages
SPLIT_BACKWARD = frozenset(
    {PipelineSchedule.INTERLEAVED_ZERO_BUBBLE, PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV}
)
ROUNDED = frozenset({PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.INTERLEAVED_ZERO_BUBBLE})


def splits_backward(pp: int, kind: PipelineSchedule) -> bool:
    """Whether a pipeline of ``pp`` ranks runs ``kind``, whose backward comes in two halves
    (inputs, then weights): blocks then stay eager, whatever ``train.compile`` resolves to
    (torch 2.13's compiled backward frees its saved buffers after the first half)."""
    return pp > 1 and kind in SPLIT_BACKWARD


def is_multi_stage(kind: PipelineSchedule) -> bool:
    """Whether ``kind`` is built with a list of stages (else with one stage object)."""
    return kind not in SINGLE_STAGE


def local_stages(kind: PipelineSchedule, pp: int, per_rank: int, rank: int) -> tuple[int, ...]:
    """The stage indices pipeline rank ``rank`` holds, in order. Looped layout: ``rank``,
    ``rank + pp``, ...; V layout (``zbv``, ``dualpipev``, two stages per rank): ``rank`` and
    ``2 * pp - 1 - rank``, so the first and the last stage share rank 0."""
    if kind in V_SHAPED:
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + pp * k for k in range(per_rank))


def stage_rank(kind: PipelineSchedule, pp: int, per_rank: int, stage: int) -> int:
    """The pipeline rank that holds ``stage`` (the inverse of ``local_stages``)."""
    for rank in range(pp):
        if stage in local_stages(kind, pp, per_rank, rank):
            return rank
    raise ValueError(f"stage {stage} is not among the {pp * per_rank} stages")


def greedy_parts(costs: Sequence[int], n_stages: int, limit: int) -> list[int] | None:
    """Boundaries of contiguous parts, each as long as it fits under ``limit`` but leaving one
    item for each part still to come; None when ``n_stages`` parts cannot hold them."""
    bounds, total, left = [], 0, n_stages - 1
    for i, cost in enumerate(costs):
        if cost > limit:
            return None
        must_cut = left > 0 and len(costs) - i == left  # every later part needs one item
        if i > 0 and (total + cost > limit or must_cut):
            if left == 0:
                return None
            bounds.append(i)
            total, left = 0, left - 1
        total += cost
    return bounds if left == 0 else None


def balanced_boundaries(costs: Sequence[int], n_stages: int) -> tuple[int, ...]:
    """Where stages 1..n-1 begin when contiguous runs of items (layers, with the embedding
    counted into the first and the head into the last) split into ``n_stages`` non-empty
    stages of the smallest possible largest cost. Of the splits that reach it, the earlier
    stages take as many items as fit (equal costs: the remainder goes to the first stages)."""
    if not 1 <= n_stages <= len(costs):
        raise ValueError(f"cannot split {len(costs)} layers into {n_stages} stages")
    low, high = max(costs), sum(costs)
    while low < high:  # the smallest limit under which the greedy split fits
        mid = (low + high) // 2
        if greedy_parts(costs, n_stages, mid) is None:
            low = mid + 1
        else:
            high = mid
    bounds = greedy_parts(costs, n_stages, low)
    assert bounds is not None
    return tuple(bounds)


def layer_costs(layer_params: Sequence[int], embedding: int, head: int) -> list[int]:
    """Each layer's parameters, the embedding's added to the first layer and the final norm's
    and head's to the last: they always sit on the first and the last stage."""
    costs = list(layer_params)
    costs[0] += embedding
    costs[-1] += head
    return costs


def stage_layers(boundaries: Sequence[int], n_layers: int) -> list[range]:
    """Each stage's layers from where stages 1..n-1 begin."""
    edges = [0, *boundaries, n_layers]
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def boundary_problems(boundaries: Sequence[int], n_layers: int, n_stages: int) -> list[str]:
    """Why ``distributed.pp_stage_boundaries`` cannot split ``n_layers`` into ``n_stages``."""
    p: list[str] = []
    if len(boundaries) != n_stages - 1:
        count = len(boundaries)
        p.append(f"needs {n_stages - 1} entries (stages - 1) for {n_stages} stages, got {count}")
    if any(b <= a for a, b in itertools.pairwise(boundaries)):
        p.append(f"must be strictly increasing, got {list(boundaries)}")
    if any(not 0 < b < n_layers for b in boundaries):
        p.append(f"each entry must lie in 1..{n_layers - 1} (model.n_layers={n_layers})")
    return p


def rounds_fit(n_micro: int, pp: int) -> bool:
    """The interleaved schedules' rule: the micro-batches fill whole rounds, ``n // pp`` of
    them (at least one)."""
    return n_micro % max(1, n_micro // pp) == 0


def nearest_fits(n_micro: int, pp: int) -> tuple[int, int]:
    """The closest micro-batch counts below and above ``n_micro`` that ``rounds_fit``."""
    below = next(n for n in range(n_micro, 0, -1) if rounds_fit(n, pp))
    above = next(n for n in range(n_micro, 4 * n_micro + 2 * pp) if rounds_fit(n, pp))
    return below, above


def schedule_problems(
    kind: PipelineSchedule, pp: int, per_rank: int, n_micro: int
) -> list[Problem]:
    """What ``kind`` needs of the stages per rank and of the micro-batches per step
    (``train.grad_accum_steps``), as measured on torch 2.13 (see the module's table)."""
    name, p = f"pp_schedule='{kind.value}'", list[Problem]()
    if kind in SINGLE_STAGE and per_rank != 1:
        message = f"must be 1 with distributed.{name}; use 'interleaved_1f1b' for several"
        p.append(("distributed.pp_stages_per_rank", message))
    if kind in V_SHAPED and per_rank != 2:
        message = f"must be 2 with distributed.{name} (rank r holds stages r and 2*pp-1-r)"
        p.append(("distributed.pp_stages_per_rank", f"{message}, got {per_rank}"))
    micro, where = "train.grad_accum_steps", f"with distributed.pp={pp} and {name}"
    if kind is PipelineSchedule.ONE_F_ONE_B and n_micro < pp:
        p.append((micro, f"must be >= {pp} (the pipeline's micro-batches per step) {where}"))
    if kind is PipelineSchedule.DUALPIPEV and n_micro < 2 * pp:
        p.append((micro, f"must be >= {2 * pp} (the stages, 2 per rank) {where}"))
    if kind in ROUNDED and not rounds_fit(n_micro, pp):
        below, above = nearest_fits(n_micro, pp)
        rule = "must fill whole rounds (a multiple of grad_accum_steps // pp)"
        p.append((micro, f"{rule} {where}: {below} or {above}, not {n_micro}"))
    return p
