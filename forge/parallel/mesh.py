"""Process group and device mesh: the effectful half of ``setup_distributed``."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from typing import TypeVar

import torch
import torch.distributed as dist

# torch.distributed.{PrefixStore,Store,TCPStore}, from where they are defined (pyright reads
# torch.distributed's re-export of them as private)
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from forge.config.sections import DistributedConfig
from forge.errors import UserInputError
from forge.parallel.world import MESH_ORDER, MeshDims, WorldInfo

T = TypeVar("T")


def coordinates(rank: int, dims: MeshDims) -> dict[str, int]:
    """This rank's index along each dim of the row-major mesh (pp, dp_replicate, dp_shard, cp,
    tp)."""
    coords: dict[str, int] = {}
    rest = rank
    for name in reversed(MESH_ORDER):
        size = getattr(dims, name)
        coords[name] = rest % size
        rest //= size
    return coords


def usable_backend(spec: str, cuda: bool) -> str:
    """``cpu:gloo,cuda:nccl`` minus the device entries this machine lacks (a CPU-only torch has
    no NCCL): ``gloo`` on a CPU machine."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if all(":" not in e for e in entries):
        return spec
    kept = [e for e in entries if cuda or not e.startswith("cuda:")]
    if len(kept) == 1:
        return kept[0].split(":", 1)[1]
    return ",".join(kept)


def backend_problem(spec: str, cuda: bool) -> str | None:
    """Why ``distributed.backend`` cannot start here (a backend this torch lacks, or NCCL
    without a GPU), or None."""
    backend = usable_backend(spec, cuda)
    for name in (e.split(":", 1)[-1].strip().lower() for e in backend.split(",")):
        if not name:
            why = f"it names no backend for this machine's devices ({'cuda' if cuda else 'cpu'})"
        elif name == "nccl" and not cuda:
            why = "NCCL needs CUDA devices and this machine has none"
        elif not dist.is_backend_available(name):
            why = f"this torch has no {name!r} backend"
        else:
            continue
        return (
            f"distributed.backend: {spec!r}: {why}; use 'gloo' on CPUs, or the default "
            "'cpu:gloo,cuda:nccl' (each device takes its own)"
        )
    return None


def device_for(world: WorldInfo) -> torch.device:
    """The local GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def round_store(world: WorldInfo, timeout: datetime.timedelta) -> Store | None:
    """This restart round's part of torchrun's shared store (a client of the agent's TCPStore
    under ``world.store_prefix``, so that no key of an earlier round is read); None to let
    ``init_process_group`` make its store from ``MASTER_ADDR`` / ``MASTER_PORT`` as usual."""
    if world.store_prefix is None:
        return None
    agent = TCPStore(world.master_addr, world.master_port, is_master=False, timeout=timeout)
    return PrefixStore(world.store_prefix, agent)


# the flight recorder's ring: enough for one step's collectives of a large FSDP model
FR_ENTRIES = 2000

# TORCH_NCCL_ASYNC_ERROR_HANDLING=2, "clean up only": on a timeout the watchdog aborts the
# communicators and leaves the process alive, so the error reaches the step as an exception
CLEAN_UP_ONLY = "2"


def nccl_environment(env: Mapping[str, str], timeout_s: float) -> dict[str, str]:
    """The variables to set before the process group starts (those the user set are kept):
    abort-not-kill error handling, the flight recorder that names a stalled collective
    (``forge.resilience.stalls``), and a heartbeat monitor slower than the collective
    timeout (else it kills a process whose watchdog is still waiting the timeout out)."""
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": CLEAN_UP_ONLY,
        "TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES),
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(timeout_s) * 2 + 60),
    }
    return {k: v for k, v in wanted.items() if k not in env}


def init_process_group(
    world: WorldInfo, cfg: DistributedConfig, dims: MeshDims
) -> DeviceMesh | None:
    """Start the default process group and build the named mesh; None for a single process."""
    if world.world_size == 1:
        return None
    os.environ.setdefault("MASTER_ADDR", world.master_addr)
    os.environ.setdefault("MASTER_PORT", str(world.master_port))
    if not dist.is_initialized():
        if (problem := backend_problem(cfg.backend, torch.cuda.is_available())) is not None:
            raise UserInputError(problem)
        os.environ.update(nccl_environment(os.environ, cfg.timeout_s))
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        dist.init_process_group(
            backend=usable_backend(cfg.backend, torch.cuda.is_available()),
            store=round_store(world, timeout),
            rank=world.rank,
            world_size=world.world_size,
            timeout=timeout,
        )
    split = dims.ep > 1 and dims.dp_shard_mod_ep > 1
    named = dims.expert_named() if split else dims.named()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(
        device_type,
        tuple(size for _, size in named),
        mesh_dim_names=tuple(name for name, _ in named),
    )
    if split:  # dense parameters shard over both parts together, under the usual name
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    if dims.dp_shard > 1 and dims.cp > 1:  # FSDP2 shards (and averages) over both together
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def has_dim(mesh: DeviceMesh, name: str) -> bool:
    """Whether ``mesh`` has a dim ``name``, as built or flattened (size-1 dims were dropped,
    but for ``MeshDims.named``'s one)."""
    if name in (mesh.mesh_dim_names or ()):
        return True
    try:
        mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def submesh(mesh: DeviceMesh | None, *names: str) -> DeviceMesh | None:
    """The sub-mesh over ``names`` that exist in ``mesh`` (most size-1 dims were dropped)."""
    if mesh is None or mesh.mesh_dim_names is None:
        return None
    present = [n for n in names if has_dim(mesh, n)]
    if not present:
        return None
    return mesh[present[0]] if len(present) == 1 else mesh[tuple(present)]


def data_parallel_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh FSDP2 shards over and averages gradients across: every rank that holds
    distinct tokens (``dp_replicate × dp_shard × cp``; context-parallel ranks compute
    gradients from different tokens of the same rows). ``dp_shard`` and ``cp`` are one
    flattened dim ``dp_shard_cp`` when both are there; None for one process. With
    ``dp_replicate`` FSDP2 gets a 2-D mesh and replicates over its first dim (HSDP): the
    replicas alone are ``(dp_replicate, dp_shard = 1)`` (``MeshDims.named``), whole
    parameters on every replica."""
    if mesh is not None and has_dim(mesh, "dp_shard_cp"):
        return submesh(mesh, "dp_replicate", "dp_shard_cp")
    return submesh(mesh, "dp_replicate", "dp_shard", "cp")


def expert_meshes(
    mesh: DeviceMesh | None, dims: MeshDims
) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """Expert parallelism's two meshes: the ``ep`` ranks that split the experts between them,
    and the other data-parallel ranks, over which FSDP2 shards each rank's experts (None where
    there is none); ``(None, None)`` without expert parallelism."""
    if mesh is None or dims.ep <= 1:
        return None, None
    if dims.dp_shard_mod_ep == 1:  # ep is all of dp_shard
        return submesh(mesh, "dp_shard"), submesh(mesh, "dp_replicate")
    return submesh(mesh, "ep"), submesh(mesh, "dp_replicate", "dp_shard_mod_ep")


def end_process_group() -> None:
    """Barrier, then destroy the default group (if any)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def broadcast_from_main(value: object, world_size: int) -> object:
    """Rank 0's ``value`` on every rank (as is for one process): for a decision only rank 0
    can make, such as taking the run directory's lock."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_every_rank(value: T, world_size: int) -> list[T]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` for one process."""
    if world_size == 1:
        return [value]
    gathered: list[T | None] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered  # type: ignore[return-value]


def host_names(world: WorldInfo) -> tuple[str, ...]:
    """Every rank's host name in rank order, gathered once at set-up (the warnings and errors
    that name a rank name its host too)."""
    return tuple(str(n) for n in from_every_rank(socket.gethostname(), world.world_size))
