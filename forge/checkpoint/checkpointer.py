"""Saving with at most one save in flight: write to ``step_<N>.tmp``, commit when durable.

A save stages the state, writes DCP shards (in the background with ``async_mode = "async"``)
and the RNG file into ``step_<N>.tmp``. The commit (train state, rename to ``step_<N>``,
``latest`` moved by atomic rename, retention) happens only in ``wait()``, once every rank's
shards are written: before the next save, before the final save returns, and before exit.
DCP's collectives run on a dedicated gloo group so they never interleave with training ones.
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.utils._pytree import tree_map

from forge.checkpoint.store import (
    STATE_DICT_OPTIONS,
    capture_rng,
    commit_checkpoint,
    single_process_dcp,
    step_dir,
)
from forge.config.sections import AsyncMode


@attrs.define
class PendingSave:
    step: int
    tmp: pathlib.Path
    train_state: dict[str, Any]
    future: Future | None  # None: already written (synchronous save)


def _stage(value: Any) -> Any:
    """A private copy of a tensor (the training loop will mutate the live one)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class CloneStager(AsyncStager):
    """Staging for ``async_save``: one private copy of every tensor, made before it returns.

    Replaces DCP's default stager, which in a single process did not isolate the state from
    the next training step, and which costs a second full copy when we copy anyway.
    """

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return tree_map(_stage, state_dict)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """No resources to release."""


class Checkpointer:
    """Saves and commits checkpoints under ``root``; ``on_commit(step, path)`` runs on rank 0
    after each commit (retention, hooks)."""

    def __init__(
        self,
        root: pathlib.Path,
        mode: AsyncMode,
        rank: int,
        world_size: int,
        on_commit: Callable[[int, pathlib.Path], None] = lambda step, path: None,
    ) -> None:
        self.root = root
        self.mode = mode
        self.rank = rank
        self.on_commit = on_commit
        self.group: dist.ProcessGroup | None = None
        if world_size > 1:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)
            self.group = group
        self.pending: PendingSave | None = None

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
    ) -> None:
        """Start a save of ``step`` (waiting for the previous one first)."""
        self.wait()
        tmp = self.root / f"step_{step}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        state = {"model": model_sd, "optimizer": optim_sd}
        torch.save(capture_rng(), tmp / f"rng_rank{self.rank}.pt")
        future = None
        with single_process_dcp():
            if self.mode is AsyncMode.DISABLED:
                dcp_save(state, checkpoint_id=str(tmp), process_group=self.group)
            else:
                result = async_save(
                    state,
                    checkpoint_id=str(tmp),
                    process_group=self.group,
                    async_stager=CloneStager(),
                )
                future = result if isinstance(result, Future) else result.upload_completion
        self.pending = PendingSave(step, tmp, train_state, future)
        if self.mode is AsyncMode.DISABLED:
            self.wait()

    def wait(self) -> pathlib.Path | None:
        """Finish and commit the save in flight, if any; returns the committed path."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if pending.future is not None:
            pending.future.result()
        self._barrier()  # every rank's shards are written
        final = step_dir(self.root, pending.step)
        if self.rank == 0:
            commit_checkpoint(self.root, pending.tmp, pending.step, pending.train_state)
            self.on_commit(pending.step, final)
        self._barrier()
        return final

    @property
    def in_flight(self) -> int | None:
        """The step being written, if any."""
        return self.pending.step if self.pending else None


def save_checkpoint(
    root: pathlib.Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    *,
    rank: int = 0,
) -> pathlib.Path:
    """Write ``step_<step>`` synchronously, in one process; returns its path. (Training uses
    ``Checkpointer``, which also handles many ranks and async saves.)"""
    writer = Checkpointer(root, AsyncMode.DISABLED, rank, world_size=1)
    writer.save(step, model, optimizer, train_state)
    return step_dir(root, step)
