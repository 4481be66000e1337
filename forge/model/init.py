"""Initial weights as pure functions of (parameter name, shape, seed), built shard by shard.

A parameter's full value is a grid of tiles (``TILE`` × ``TILE`` over its last two dimensions,
one index at a time over any before them), each tile drawn from a generator of its own seeded
by (seed, name, tile index). Any rectangular part of the value is therefore computed from the
tiles it overlaps alone: each rank builds only its own shard of each parameter, and the full
weights are bit-identical whatever the world size, the sharding, the pipeline split, the
construction order or the device (values are drawn on the CPU and copied to the parameter).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from forge.config.sections import ModelConfig

# The tile edge: large enough that the per-tile cost (a hash, a generator seed) is noise next
# to drawing 65,536 values, small enough that an uneven shard overdraws little.
TILE = 256

# (start, stop) of each dimension: the part of a full value a shard holds
Region = tuple[tuple[int, int], ...]

# the projections that write into the residual stream: their init is scaled down by depth
RESIDUAL_OUTPUTS = (
    "attention.wo.weight",
    "feed_forward.w2.weight",
    "feed_forward.experts.w2",
    "feed_forward.shared.w2.weight",
)


def whole(shape: tuple[int, ...]) -> Region:
    """The region that covers all of ``shape``."""
    return tuple((0, n) for n in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    """The shape of the part ``region`` selects."""
    return tuple(stop - start for start, stop in region)


def tile_edges(ndim: int) -> tuple[int, ...]:
    """The tile's extent in each of ``ndim`` dimensions: ``TILE`` in the last two, 1 before."""
    return tuple(TILE if d >= ndim - 2 else 1 for d in range(ndim))


def tiles_overlapping(shape: tuple[int, ...], region: Region) -> list[Region]:
    """The tiles of a ``shape`` grid that ``region`` overlaps, each as its own region."""
    edges = tile_edges(len(shape))
    spans = [
        range(start // edge, math.ceil(stop / edge)) if stop > start else range(0)
        for (start, stop), edge in zip(region, edges, strict=True)
    ]
    return [
        tuple((i * e, min((i + 1) * e, n)) for i, e, n in zip(index, edges, shape, strict=True))
        for index in itertools.product(*spans)
    ]


def tile_seed(seed: int, name: str, tile: Region) -> int:
    """The generator seed of one tile of parameter ``name``: a hash of (seed, name, tile)."""
    corner = ",".join(str(start) for start, _ in tile)
    digest = hashlib.sha256(f"{seed}:{name}:{corner}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seeded_normal(
    name: str, shape: tuple[int, ...], std: float, seed: int, region: Region | None = None
) -> torch.Tensor:
    """Normal(0, ``std``) values of ``region`` (default: all) of parameter ``name``'s full
    value, drawn tile by tile from generators seeded by (seed, name, tile)."""
    region = whole(shape) if region is None else region
    out = torch.empty(region_shape(region))
    gen = torch.Generator()
    for tile in tiles_overlapping(shape, region):
        gen.manual_seed(tile_seed(seed, name, tile))
        values = torch.empty(region_shape(tile)).normal_(0.0, std, generator=gen)
        src = tuple(
            slice(max(r0, t0) - t0, min(r1, t1) - t0)
            for (r0, r1), (t0, t1) in zip(region, tile, strict=True)
        )
        dst = tuple(
            slice(max(r0, t0) - r0, min(r1, t1) - r0)
            for (r0, r1), (t0, t1) in zip(region, tile, strict=True)
        )
        out[dst] = values[src]
    return out


def initial_value(
    name: str,
    shape: tuple[int, ...],
    cfg: ModelConfig,
    seed: int,
    region: Region | None = None,
) -> torch.Tensor:
    """``region`` (default: all) of the initial value of decoder parameter ``name``.

    Norm weights are ones; residual output projections (``wo``, every ``w2``) are normal with
    std ``init_std / sqrt(2 n_layers)``; everything else normal with ``init_std``.
    """
    region = whole(shape) if region is None else region
    if name.endswith("norm.weight"):
        return torch.ones(region_shape(region))
    std = cfg.init_std
    if name.endswith(RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2 * cfg.n_layers)
    return seeded_normal(name, shape, std, seed, region)


def local_region(p: torch.Tensor) -> Region | None:
    """The part of the full value that ``p`` holds on this rank: all of it for a plain
    tensor, its shard for a DTensor of ``Shard`` / ``Replicate`` placements and the strided
    shard FSDP2 puts over a TP shard (FSDP×TP: a data-parallel chunk of the TP chunk, one
    rectangle); None for any other layout (a partial placement), which then builds the full
    value and keeps its shard."""
    if not isinstance(p, DTensor):
        return whole(tuple(p.shape))
    if any(type(pl) not in (Shard, Replicate, _StridedShard) for pl in p.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(p.to_local().shape):  # a layout the offsets do not describe
        return None
    return tuple((start, start + n) for start, n in zip(offset, shape, strict=True))


@torch.no_grad()
def fill_(p: torch.Tensor, value_of: Callable[[Region], torch.Tensor]) -> None:
    """Set ``p`` (plain or DTensor) to its part of a full value, where ``value_of(region)``
    computes any region of that value: a shard asks for its own region only."""
    region = local_region(p)
    if region is not None:
        local = p.to_local() if isinstance(p, DTensor) else p
        local.copy_(value_of(region))
    else:
        copy_full_(p, value_of(whole(tuple(p.shape))))


@torch.no_grad()
def copy_full_(p: torch.Tensor, full: torch.Tensor) -> None:
    """Set parameter ``p`` to the full value ``full``; a sharded (DTensor) ``p`` keeps only
    its own shard of it."""
    if isinstance(p, DTensor):
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(local.to_local())
    else:
        p.copy_(full)
