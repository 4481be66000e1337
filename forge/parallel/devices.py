"""Where and in what dtype the scripts beside training (eval, generate, convert, lm-eval) run
(their ``--device`` and ``--dtype``: ``forge.cli``).

The choice is pure (``choose_device``, ``choose_dtype``: table-tested on any machine); the
effects (``start_script_world``: the GPU made current, the process group started with the
round's store) follow it. Under ``torchrun`` on GPUs each rank takes ``cuda:<local_rank>``
and NCCL, else the CPU and gloo, so a collective always runs on the device its tensors are on.
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from forge.cli import DeviceRequest, DtypeRequest
from forge.config.sections import Precision
from forge.parallel.mesh import nccl_environment, round_store
from forge.parallel.world import WorldInfo, world_info


@attrs.frozen
class DeviceChoice:
    """The device a script's rank runs on and the process-group backend for it; ``problem``
    (one line) instead when the request cannot be met."""

    device: str = "cpu"
    backend: str = "gloo"
    problem: str | None = None


def choose_device(
    request: DeviceRequest, cuda_available: bool, gpus: int, local_rank: int
) -> DeviceChoice:
    """The device for the rank ``local_rank`` of its node, given what torch sees."""
    if request is DeviceRequest.CPU or (request is DeviceRequest.AUTO and not cuda_available):
        return DeviceChoice("cpu", "gloo")
    if not cuda_available:
        return DeviceChoice(
            problem="--device cuda: torch sees no GPU here (a CPU build of torch, or "
            "CUDA_VISIBLE_DEVICES empty); pass --device cpu or --device auto"
        )
    if local_rank >= gpus:
        return DeviceChoice(
            problem=f"--device: local rank {local_rank} has no GPU of its own ({gpus} visible); "
            f"start at most {gpus} ranks per node, or pass --device cpu"
        )
    return DeviceChoice(f"cuda:{local_rank}", "nccl")


def choose_dtype(request: DtypeRequest, stored: torch.dtype) -> torch.dtype:
    """The dtype the weights are held in: the checkpoint's (``stored``) unless one is asked for."""
    if request is DtypeRequest.AUTO:
        return stored
    return torch.bfloat16 if request is DtypeRequest.BFLOAT16 else torch.float32


def stored_dtype(param_dtype: Precision) -> torch.dtype:
    """The dtype a run's checkpoints hold its weights in (``train.param_dtype``)."""
    return torch.bfloat16 if param_dtype is Precision.BF16 else torch.float32


def start_script_world(
    world: WorldInfo, choice: DeviceChoice, timeout_s: float = 600.0
) -> torch.device:
    """Make the chosen GPU current and, under a launcher with several ranks, start the process
    group on the backend that matches it (under torchrun's store, this restart round's
    part); returns the device. ``choice.problem`` must be None."""
    assert choice.problem is None, choice.problem
    device = torch.device(choice.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world.world_size > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", world.master_addr)
        os.environ.setdefault("MASTER_PORT", str(world.master_port))
        os.environ.update(nccl_environment(os.environ, timeout_s))
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=choice.backend,
            store=round_store(world, timeout),
            rank=world.rank,
            world_size=world.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    return device


def end_script_world() -> None:
    """Destroy the process group ``start_script_world`` started, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()


def run_on_chosen_device(
    args: argparse.Namespace, body: Callable[[argparse.Namespace, WorldInfo, DeviceChoice], int]
) -> int:
    """A script's ``body`` on the device ``args.device`` asks for at this rank (its local GPU
    where there is one), the process group it may start always ended; its exit code."""
    world = world_info(os.environ)
    choice = choose_device(
        args.device, torch.cuda.is_available(), torch.cuda.device_count(), world.local_rank
    )
    try:
        return body(args, world, choice)
    finally:
        end_script_world()
