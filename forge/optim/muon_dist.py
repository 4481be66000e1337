"""Muon's Newton–Schulz orthogonalisation, on one process and distributed (owner computes).

A sharded matrix's Newton–Schulz iteration needs the whole matrix. The gather-everything path
(``orthogonalized``) gathers it on every rank, so each rank orthogonalises the whole model.
The distributed path (``orthogonalize_all``) gives each matrix one owner instead: whole
matrices are assigned to the ranks of their device mesh (greedy by Newton–Schulz FLOPs, a
pure function, so every rank computes the same assignment without talking), one
``all_to_all`` sends every shard to its matrix's owner, each owner runs the iteration on its
own matrices only, and a second ``all_to_all`` sends each rank its shard of every result. The
owner sees exactly the matrix ``full_tensor()`` would build and runs the same iteration, so
the results equal the gather-everything path's bit for bit.

Matrices travel in buckets of whole rounds (round ``r``: the ``r``-th matrix of every rank),
two collectives per bucket, so a step's traffic is a few collectives, not one per matrix,
while a bucket's buffers stay bounded on large models. A matrix takes the distributed path
when it is a ``DTensor`` split (``Shard(d)``) along one mesh dim of more than one rank and
replicated along any others (FSDP2, TP alone, HSDP: the owners are the ranks of that dim, and
each replica group repeats the work). Sharded along two mesh dims (FSDP2 × TP), replicated,
or a plain tensor, it takes ``orthogonalized`` (gathered on every rank of its mesh; no
communication for the latter two).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# Newton–Schulz quintic coefficients (Keller Jordan's Muon)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# a bucket closes once its whole matrices hold this many elements (256 MiB in fp32): on the
# debug model every matrix fits in one bucket; with an 8B model's ~59M-element FFN matrices
# each bucket is one round, so a rank's send and receive buffers hold about one full matrix
BUCKET_NUMEL = 2**26


def newton_schulz(matrix: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix with ``matrix``'s singular vectors (US'V^T with
    S' near 1), in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def orthogonalized(update: torch.Tensor, steps: int) -> torch.Tensor:
    """``newton_schulz`` of the full matrix, returned in ``update``'s layout: the
    gather-everything path (each rank gathers a ``DTensor`` once, iterates on the full
    matrix and keeps its shard)."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps).to(update.dtype)
    full = newton_schulz(update.full_tensor(), steps).to(update.dtype)
    # every rank computed the same full matrix: slice it locally, no communication
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


# --- pure decisions: costs, owners, shard geometry, buckets ---------------------------------


def ns_flops(shape: Sequence[int], steps: int) -> int:
    """The multiply-add FLOPs of ``steps`` Newton–Schulz iterations on a ``shape`` matrix
    (an integer, so every rank ranks equal matrices identically)."""
    small, large = min(shape[0], shape[1]), max(shape[0], shape[1])
    # per step: the gram (s·s·l), gram @ gram (s³), and the product with x (s·s·l)
    return steps * 2 * (2 * small * small * large + small**3)


def assign_owners(costs: Sequence[int], world: int) -> tuple[int, ...]:
    """The rank that orthogonalises each matrix: largest first, each to the least loaded
    rank (ties to the lower rank), so loads stay within one matrix of each other."""
    owners = [0] * len(costs)
    loads = [0] * world
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return tuple(owners)


def rounds(owners: Sequence[int], costs: Sequence[int], world: int) -> list[list[int]]:
    """The matrices by round: round ``r`` holds the ``r``-th matrix of each rank (in the
    order ``assign_owners`` handed them out, largest first), sorted by index."""
    per_rank: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        per_rank[owners[i]].append(i)
    depth = max((len(m) for m in per_rank), default=0)
    return [sorted(m[r] for m in per_rank if r < len(m)) for r in range(depth)]


def buckets(
    by_round: Sequence[Sequence[int]], numels: Sequence[int], limit: int
) -> list[list[int]]:
    """Consecutive whole rounds per bucket, a bucket closing once its matrices hold
    ``limit`` elements (at least one round each)."""
    out: list[list[int]] = []
    current: list[int] = []
    for matrices in by_round:
        current.extend(matrices)
        if sum(numels[i] for i in current) >= limit:
            out.append(sorted(current))
            current = []
    if current:
        out.append(sorted(current))
    return out


def shard_sizes(length: int, world: int) -> list[int]:
    """The length of each rank's shard of a dimension under ``Shard``: ``torch.chunk``'s
    split (chunks of ``ceil(length / world)``; the last ranks' may be short or empty)."""
    chunk = -(-length // world)
    return [max(0, min(chunk, length - r * chunk)) for r in range(world)]


# --- effects: the owner-computes path -------------------------------------------------------


def sharding_mesh(update: torch.Tensor) -> DeviceMesh | None:
    """The 1-D mesh (of more than one rank) over which the matrix ``update`` is split, when
    it takes the distributed path: exactly one plain ``Shard`` placement (not strided), every
    other mesh dim ``Replicate`` (FSDP2, TP alone, HSDP's shard dim). None otherwise (a plain
    or replicated tensor, FSDP2 × TP's two sharded dims, a partial sum, an unnamed N-D mesh)."""
    if not isinstance(update, DTensor) or update.ndim != 2:
        return None
    mesh, placements = update.device_mesh, update.placements
    sharded = [d for d, p in enumerate(placements) if type(p) is Shard]
    replicated = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    if len(sharded) != 1 or len(sharded) + len(replicated) != mesh.ndim:
        return None
    if mesh.ndim == 1:
        return mesh if mesh.size() > 1 else None
    names = mesh.mesh_dim_names
    if names is None:  # a sub-mesh is taken by name
        return None
    sub = mesh[names[sharded[0]]]
    return sub if sub.size() > 1 else None


def orthogonalize_all(
    updates: Sequence[torch.Tensor], steps: Sequence[int], distributed: bool = True
) -> list[torch.Tensor]:
    """``orthogonalized`` of each update, each in its own layout. ``distributed``: sharded
    matrices (``sharding_mesh``) are orthogonalised once, by their owner, per mesh and
    dtype; every rank of a mesh must pass the same matrices in the same order (the
    parameters with a gradient, which FSDP2 and TP make the same on every rank)."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    shared: dict[tuple[DeviceMesh, torch.dtype], list[tuple[int, DTensor]]] = {}
    for i, u in enumerate(updates):
        mesh = sharding_mesh(u) if distributed else None
        if mesh is not None and isinstance(u, DTensor):
            shared.setdefault((mesh, u.dtype), []).append((i, u))
        else:
            out[i] = orthogonalized(u, steps[i])
    for (mesh, _), pairs in shared.items():  # insertion order: the same on every rank
        results = owner_computes([u for _, u in pairs], [steps[i] for i, _ in pairs], mesh)
        for (i, _), result in zip(pairs, results, strict=True):
            out[i] = result
    return [o for o in out if o is not None]


def owner_computes(
    updates: Sequence[DTensor], steps: Sequence[int], mesh: DeviceMesh
) -> list[torch.Tensor]:
    """The orthogonalised ``updates`` (``DTensor``s whose ``sharding_mesh`` is ``mesh``),
    each computed by its owner in ``mesh`` only, returned in the update's own layout."""
    world = mesh.size()
    costs = [ns_flops(u.shape, s) for u, s in zip(updates, steps, strict=True)]
    owners = assign_owners(costs, world)
    shards: dict[int, torch.Tensor] = {}
    for bucket in buckets(rounds(owners, costs, world), [u.numel() for u in updates], BUCKET_NUMEL):
        exchange = Exchange([updates[i] for i in bucket], [owners[i] for i in bucket], mesh)
        mine = [bucket[b] for b in exchange.mine]
        fulls = exchange.gather()
        results = [newton_schulz(f, steps[i]).to(f.dtype) for f, i in zip(fulls, mine, strict=True)]
        shards.update(zip(bucket, exchange.scatter(results), strict=True))
    return [
        DTensor.from_local(
            shards[i],
            u.device_mesh,
            u.placements,
            run_check=False,
            shape=u.shape,
            stride=u.stride(),
        )
        for i, u in enumerate(updates)
    ]


def shard_dim(update: DTensor) -> int:
    """The matrix dimension that ``update``'s one ``Shard`` placement splits."""
    (placement,) = [p for p in update.placements if isinstance(p, Shard)]
    return placement.dim


class Exchange:
    """One bucket's two ``all_to_all``s over the 1-D sharding mesh: every shard to its
    matrix's owner (``gather``), and each owner's results back as shards (``scatter``)."""

    def __init__(self, updates: Sequence[DTensor], owners: Sequence[int], mesh: DeviceMesh) -> None:
        self.updates = list(updates)
        self.owners = list(owners)
        self.world, self.me, self.group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
        self.dims = [shard_dim(u) for u in self.updates]
        self.sizes = [
            shard_sizes(u.shape[d], self.world)
            for u, d in zip(self.updates, self.dims, strict=True)
        ]
        self.mine = [b for b, o in enumerate(self.owners) if o == self.me]

    def shard_shape(self, b: int, rank: int) -> list[int]:
        """The shape of ``rank``'s shard of the bucket's ``b``-th matrix."""
        shape = list(self.updates[b].shape)
        shape[self.dims[b]] = self.sizes[b][rank]
        return shape

    def numel(self, b: int, rank: int) -> int:
        """The element count of ``rank``'s shard of the bucket's ``b``-th matrix."""
        return self.sizes[b][rank] * self.updates[b].shape[1 - self.dims[b]]  # a matrix

    def owned_by(self, rank: int) -> list[int]:
        """The bucket's matrices that ``rank`` owns, in bucket order."""
        return [b for b, o in enumerate(self.owners) if o == rank]

    def gather(self) -> list[torch.Tensor]:
        """The full matrices this rank owns (bucket order), from every rank's shards."""
        for b, u in enumerate(self.updates):  # the split sizes below assume torch.chunk's split
            assert list(u.to_local().shape) == self.shard_shape(b, self.me), "not a chunk shard"
        to_send = [b for r in range(self.world) for b in self.owned_by(r)]
        send = self.flat([self.updates[b].to_local() for b in to_send])
        send_splits = [
            sum(self.numel(b, self.me) for b in self.owned_by(r)) for r in range(self.world)
        ]
        recv_splits = [sum(self.numel(b, r) for b in self.mine) for r in range(self.world)]
        recv = self.all_to_all(send, send_splits, recv_splits)
        pieces: dict[int, list[torch.Tensor]] = {b: [] for b in self.mine}
        offset = 0
        for r in range(self.world):  # from each rank, its shard of each of my matrices
            for b in self.mine:
                n = self.numel(b, r)
                pieces[b].append(recv[offset : offset + n].view(self.shard_shape(b, r)))
                offset += n
        return [torch.cat(pieces[b], dim=self.dims[b]) for b in self.mine]

    def scatter(self, results: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shard of every matrix in the bucket, from the owners' ``results``
        (the full results of this rank's matrices, in bucket order)."""
        parts = []
        for r in range(self.world):  # to each rank, its shard of each of my results
            for b, full in zip(self.mine, results, strict=True):
                start = sum(self.sizes[b][:r])
                parts.append(full.narrow(self.dims[b], start, self.sizes[b][r]))
        send = self.flat(parts)
        send_splits = [sum(self.numel(b, r) for b in self.mine) for r in range(self.world)]
        recv_splits = [
            sum(self.numel(b, self.me) for b in self.owned_by(r)) for r in range(self.world)
        ]
        recv = self.all_to_all(send, send_splits, recv_splits)
        shards: dict[int, torch.Tensor] = {}
        offset = 0
        for r in range(self.world):  # from each owner, my shard of each of its matrices
            for b in self.owned_by(r):
                n = self.numel(b, self.me)
                shards[b] = recv[offset : offset + n].view(self.shard_shape(b, self.me))
                offset += n
        return [shards[b] for b in range(len(self.updates))]

    def flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``tensors`` flattened into one buffer (an empty one when there are none)."""
        if not tensors:
            return self.updates[0].to_local().new_empty(0)
        return torch.cat([t.reshape(-1) for t in tensors])

    def all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        """One ``all_to_all_single`` over the mesh's group with uneven splits."""
        recv = send.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        return recv
