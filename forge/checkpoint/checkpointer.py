"""Saving with at most one save in flight: write to ``step_<N>.tmp``, commit when durable.

A save stages the state, writes DCP shards (in a background thread with ``async_mode =
"async"``, in torch's checkpoint process with ``"async_process"``) and the RNG file into
``step_<N>.tmp``. The commit (train state, rename to ``step_<N>``,
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
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor
from torch.utils._pytree import KeyPath, keystr, tree_map_with_path

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


class ReusingStager(AsyncStager):
    """Staging for ``async_save``: a private CPU copy of every tensor, made before it returns.

    The copies go into buffers kept from the previous save (safe: at most one save is in
    flight, and the next one starts only after it is committed), so only the first save pays
    for allocating them. With ``shared=True`` the buffers live in shared memory, so handing
    them to torch's checkpoint process sends handles, not the bytes. Replaces DCP's default
    stager, which in a single process did not isolate the state from the next training step.
    """

    _synchronize_after_execute = False

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self._buffers: dict[str, torch.Tensor] = {}

    def _copy(self, key: str, source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu")
            if self.shared:
                buffer.share_memory_()
            self._buffers[key] = buffer
        return buffer.copy_(source.detach())

    def _stage(self, path: KeyPath, value: Any) -> Any:
        if isinstance(value, DTensor):
            local = self._copy(keystr(path), value.to_local())
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._copy(keystr(path), value)
        return value

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return tree_map_with_path(self._stage, state_dict)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Release the buffers."""
        self._buffers.clear()


def stop_checkpoint_process() -> None:
    """Stop torch's checkpoint daemon process, if one was started.

    torch keeps it in a module global and stops it only in ``__del__``, which never runs when
    the script ends with ``os._exit``; the daemon would then die on a broken pipe, noisily.
    """
    process = _async_process_executor._CHECKPOINT_PROCESS
    _async_process_executor._CHECKPOINT_PROCESS = None
    if process is not None and process._save_process.is_alive():
        process._send(_async_process_executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process._save_process.join(timeout=30)
        if process._save_process.is_alive():
            process._save_process.terminate()


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
        self.stager = ReusingStager(shared=mode is AsyncMode.ASYNC_PROCESS)
        self._owns_default_group = False
        if mode is AsyncMode.ASYNC_PROCESS and not dist.is_initialized():
            # torch's checkpoint process is set up over the default group, even for one rank
            any_free_port = "tcp://127.0.0.1:0"
            dist.init_process_group("gloo", init_method=any_free_port, rank=0, world_size=1)
            self._owns_default_group = True

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
                    async_checkpointer_type=self._executor_type,
                    async_stager=self.stager,
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
    def _executor_type(self) -> AsyncCheckpointerType:
        if self.mode is AsyncMode.ASYNC_PROCESS:
            return AsyncCheckpointerType.PROCESS
        return AsyncCheckpointerType.THREAD

    def close(self) -> None:
        """Commit the save in flight, stop the checkpoint process and release staging buffers."""
        self.wait()
        if self.mode is AsyncMode.ASYNC_PROCESS:
            stop_checkpoint_process()
        self.stager.close()
        if self._owns_default_group:
            dist.destroy_process_group()
            self._owns_default_group = False

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
