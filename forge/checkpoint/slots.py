"""Named in-memory snapshots of model + optimizer state.

Used for NaN rollback without touching the disk. A slot holds clones (state dicts gathered from
a live model share memory with it), plain tensors on the CPU; sharded (DTensor) state stays a
DTensor, each rank keeping its own shards. Loading clones again, so the optimizer's in-place
updates can never reach back into a slot.

``prefetch(name, path)`` fills a slot from a disk checkpoint in a background thread while
training goes on; ``load(name)`` waits for it. Such a slot keeps DCP's layout (the one
``get_state_dict`` gives), and is restored with ``set_state_dict``.
"""

from __future__ import annotations

import enum
import pathlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from forge.checkpoint.store import STATE_DICT_OPTIONS, check_loadable, read_tensors
from forge.config.checkpoint import Verification


def _clone(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


class Layout(enum.Enum):
    MODULE = "module"  # nn.Module.state_dict() / Optimizer.state_dict()
    DCP = "dcp"  # get_state_dict(..., STATE_DICT_OPTIONS), as checkpoints store it


@attrs.frozen
class Snapshot:
    model: dict[str, Any]
    optimizer: dict[str, Any]
    layout: Layout


class Slots:
    """``push(name)`` snapshots, ``prefetch(name, path)`` reads a checkpoint in the background,
    ``load(name)`` restores in place, ``pop(name)`` forgets.

    ``process_group`` carries a prefetch's collectives when there are several ranks; it must be
    one that nothing else uses while a prefetch runs (the training loop's would deadlock).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.process_group = process_group
        self._slots: dict[str, Snapshot | Future[Snapshot]] = {}
        self._reader: ThreadPoolExecutor | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def push(self, name: str) -> None:
        """Snapshot the current model and optimizer state into slot ``name`` (replacing it)."""
        model_sd = tree_map(_clone, self.model.state_dict())
        optim_sd = tree_map(_clone, self.optimizer.state_dict())
        self._slots[name] = Snapshot(model_sd, optim_sd, Layout.MODULE)

    def prefetch(self, name: str, path: pathlib.Path) -> Future[Snapshot]:
        """Start reading checkpoint ``path`` into slot ``name``; returns at once.

        An incomplete checkpoint or one written for other shapes raises ``CheckpointError`` here;
        a failed read raises from ``load(name)`` (or the returned future).
        """
        if dist.is_initialized() and dist.get_world_size() > 1 and self.process_group is None:
            raise ValueError("Slots.prefetch with several ranks needs its own process_group")
        check_loadable(path, self.model, Verification.METADATA)  # returns at once: lengths only
        # the template is taken here, on the training thread, from the live model; the reader
        # fills private copies of it
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=STATE_DICT_OPTIONS)
        template = {"model": tree_map(_clone, model_sd), "optimizer": tree_map(_clone, optim_sd)}
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forge-prefetch")
        future = self._reader.submit(self._read, template, path)
        self._slots[name] = future
        return future

    def _read(self, template: dict[str, Any], path: pathlib.Path) -> Snapshot:
        read_tensors(template, path, self.process_group)
        return Snapshot(template["model"], template["optimizer"], Layout.DCP)

    def _snapshot(self, name: str) -> Snapshot:
        slot = self._slots[name]
        if isinstance(slot, Future):
            slot = self._slots[name] = slot.result()
        return slot

    @torch.no_grad()
    def load(self, name: str) -> None:
        """Restore slot ``name`` into the live model and optimizer (moments and step counts too;
        a snapshot taken before the first step empties the optimizer state). Waits for a
        prefetch still reading."""
        snapshot = self._snapshot(name)
        model_sd, optim_sd = tree_map(_clone, snapshot.model), tree_map(_clone, snapshot.optimizer)
        if snapshot.layout is Layout.DCP:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_sd,
                optim_state_dict=optim_sd,
                options=STATE_DICT_OPTIONS,
            )
        else:
            self.model.load_state_dict(model_sd)
            self.optimizer.load_state_dict(optim_sd)

    def pop(self, name: str) -> None:
        """Forget slot ``name`` (after a prefetch into it has finished)."""
        slot = self._slots.pop(name)
        if isinstance(slot, Future):
            slot.exception()  # wait; the reader must not outlive the slot unnoticed
