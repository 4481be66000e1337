"""The global gradient norm across FSDP shards, TP shards and pipeline stages.

``torch.nn.utils.clip_grad_norm_`` refuses a mix of plain tensors and DTensors, or DTensors on
different meshes; here the norm is computed per mesh group, reduced to a plain tensor, summed
in squares, and all-reduced over the pipeline group (each stage holds different parameters).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _mesh_key(t: torch.Tensor) -> object:
    return t.device_mesh if isinstance(t, DTensor) else None


def global_grad_norm(
    params: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The L2 norm of every gradient in the model, as a plain fp32 scalar on every rank, on the
    parameters' device (no host sync here: the caller reads it once per step)."""
    params = list(params)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_mesh_key(p.grad), []).append(p.grad)
    device = _local(params[0]).device if params else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for mesh, grads in groups.items():
        if mesh is None:  # plain tensors: one fused kernel for all norms
            norms = torch.stack(torch._foreach_norm(grads))  # pyright: ignore[reportPrivateImportUsage]
        else:
            norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
        group_norm = torch.linalg.vector_norm(norms.float())
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        squares = squares + group_norm**2
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def scale_grads_(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient by ``factor`` in place (DTensors scale their local shard)."""
    if factor == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that brings ``norm`` down to ``max_norm`` (1.0 when already below)."""
    return min(1.0, max_norm / (norm + 1e-6))
