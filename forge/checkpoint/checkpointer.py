"""Saving with at most one save in flight: write to the storage's staging place
(``step_<N>.tmp`` on a disk), commit when durable.

A save stages the state, writes DCP shards (in a background thread with ``async_mode =
"async"``, in torch's checkpoint process with ``"async_process"``) and the RNG file into the
staging place. The commit (train state, checksums, ``step_<N>`` made visible, ``latest``
moved: the storage's ``commit``; then retention) happens only in ``wait()``, once every rank's
shards are written (``status``: at the first step all have), or before the next save or exit.
DCP's collectives run on a dedicated gloo group so they never interleave with training ones;
the ranks' agreements on a save (``_gather``) on another, beside DCP's.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from forge.checkpoint.async_staging import (
    ReusingStager,
    gloo_group,
    start_checkpoint_process,
    stop_checkpoint_process,
)
from forge.checkpoint.checksum_writer import hashing_pool, written_checksums, written_shards
from forge.checkpoint.costs import SaveCost
from forge.checkpoint.integrity import checksums_of, own_files
from forge.checkpoint.object_path import StoreTimeoutError, result_while_answering
from forge.checkpoint.paths import CheckpointPath, is_remote
from forge.checkpoint.rng import RngFile, capture_rng
from forge.checkpoint.save_failures import (
    PeerLostError,
    failure_cause,
    newest_committed,
    what_remains,
)
from forge.checkpoint.storage import storage_of
from forge.checkpoint.store import (
    STATE_DICT_OPTIONS,
    commit_checkpoint,
    ignore_single_process_warning,
    single_process_dcp,
    step_dir,
)
from forge.config.sections import AsyncMode
from forge.errors import CheckpointSaveError, one_line
from forge.model.transformer import canonical_name


@attrs.define
class PendingSave:
    step: int
    tmp: CheckpointPath
    train_state: dict[str, Any]
    future: Future | None  # the write, then this rank's checksums; None: a synchronous save
    # a synchronous save's shard checksums, computed as they were written (waits for them)
    shards: Callable[[], Mapping[str, list]] = dict
    started: float = 0.0  # when ``save`` began (``time.perf_counter``)
    blocked_s: float = 0.0  # how long ``save`` held the caller


class Checkpointer:
    """Saves and commits checkpoints under ``root``; ``on_commit(step, path)`` runs on rank 0
    after each commit (retention, hooks)."""

    def __init__(
        self,
        root: CheckpointPath,
        mode: AsyncMode,
        rank: int,
        world_size: int,
        on_commit: Callable[[int, CheckpointPath], None] = lambda step, path: None,
        daemon_log: pathlib.Path | None = None,  # async_process: the checkpoint process's log
        timeout_s: float | None = None,  # several ranks: their collectives' (distributed.timeout_s)
    ) -> None:
        self.root = root
        self.storage = storage_of(root)
        self.mode = mode
        self.rank = rank
        self.on_commit = on_commit
        # DCP's collectives, and forge's agreements on a group of their own: a save given up
        # on (its store stopped answering) may still run DCP's on the first at any moment
        self.group: dist.ProcessGroup | None = None
        self.agreement: dist.ProcessGroup | None = None
        if world_size > 1:
            if timeout_s is None:
                raise ValueError("a Checkpointer of several ranks needs timeout_s")
            self.group, self.agreement = gloo_group(timeout_s), gloo_group(timeout_s)
        self.pending: PendingSave | None = None
        # once known (rank 0 lists root at the first save, then follows its commits): the
        # newest step in root, complete or not (for ``prepare``), and the newest committed,
        # the one ``latest`` names (what a failed save checks is still there)
        self._newest: int | None = None
        self._committed: int | None = None
        self.costs: list[SaveCost] = []  # this rank's, of the committed saves, to be taken
        self._hasher: ThreadPoolExecutor | None = None
        self._pieces: ThreadPoolExecutor | None = None
        self.stager = ReusingStager(shared=mode is AsyncMode.ASYNC_PROCESS)
        self._owns_default_group = False
        if mode is AsyncMode.ASYNC_PROCESS and not dist.is_initialized():
            # torch's checkpoint process is set up over the default group, even for one rank
            any_free_port = "tcp://127.0.0.1:0"
            dist.init_process_group("gloo", init_method=any_free_port, rank=0, world_size=1)
            self._owns_default_group = True
        if mode is AsyncMode.ASYNC_PROCESS and daemon_log is not None:
            start_checkpoint_process(self.group, daemon_log)

    def _gather(self, value: Any, step: int) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank (a barrier too), for the save
        of ``step``; ``PeerLostError`` when the collective itself fails."""
        if self.agreement is None:
            return [value]
        values: list[Any] = [None] * dist.get_world_size(self.agreement)
        try:
            dist.all_gather_object(values, value, group=self.agreement)
        except RuntimeError as exc:  # gloo's closed connection or timeout (DistError too)
            raise PeerLostError(step, str(exc)) from None
        return values

    def _agree(self, error: str | None, step: int) -> str | None:
        """A barrier that also agrees on failure: the first rank's error, on every rank (so
        every rank takes the same branch after a failed write)."""
        return next((e for e in self._gather(error, step) if e is not None), None)

    def _merged(
        self, sums: dict[str, list], error: str | None, gave_up: bool, step: int
    ) -> tuple[dict, str | None, bool]:
        """Every rank's checksums of the files it wrote, merged, or the first rank's error,
        and whether any rank gave its write up (one collective: a barrier too)."""
        merged: dict[str, list] = {}
        for rank_sums, rank_error, rank_gave_up in self._gather((sums, error, gave_up), step):
            error = error or rank_error
            gave_up = gave_up or rank_gave_up
            merged |= rank_sums
        return merged, error, gave_up

    def _fail(
        self, step: int, tmp: CheckpointPath, error: str, abandoned: bool = False
    ) -> CheckpointSaveError:
        """Remove the failed save's files (rank 0); the error to raise, with what rank 0
        found of the previous checkpoint and ``latest`` (checked, not assumed: a store can
        lose data mid-run), the same on every rank. Every rank calls it, after agreeing on
        ``error``."""
        remains = None
        if self.rank == 0:
            with contextlib.suppress(OSError):  # unreachable store: the save's error says more
                self.storage.discard(tmp)
            remains = what_remains(self.storage, self.root, self._committed)
        remains = self._gather(remains, step)[0]
        return CheckpointSaveError(str(self.root), step, error, remains, abandoned)

    @property
    def committed(self) -> int | None:
        """The newest committed checkpoint's step, the one ``latest`` names, once known (at
        the first save, then at each commit); None before."""
        return self._committed

    def _past_every_commit(self, step: int) -> bool:
        """Whether ``step`` is newer than every checkpoint in ``root`` (listed at the first
        save, then followed): no earlier save of it can exist."""
        if self._newest is None:
            steps = self.storage.list_steps(self.root)
            self._newest = max(steps, default=-1)
            self._committed = newest_committed(self.storage, self.root, steps)
        return step > self._newest

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
    ) -> None:
        """Start a save of ``step`` (waiting for the previous one first). A failed write, or
        weights that are not finite on any rank (``nonfinite_parameter``: such a checkpoint
        is never committed), raises ``CheckpointSaveError`` on every rank, leaving the previous
        checkpoint intact."""
        self.wait()
        started = time.perf_counter()
        tmp = self.storage.staging(self.root, step)
        try:
            error = nonfinite_parameter(model)
        except RuntimeError as exc:  # a device error: every rank must still reach the agreement
            error = one_line(exc)
        if error := self._agree(error, step):
            raise self._fail(step, tmp, error)
        if self.rank == 0:
            try:
                self.storage.prepare(self.root, tmp, fresh=self._past_every_commit(step))
            except OSError as exc:
                error = failure_cause(exc, tmp)
        if error := self._agree(error, step):
            raise self._fail(step, tmp, error)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        state = {"model": model_sd, "optimizer": optim_sd}
        rng = RngFile(tmp / f"rng_rank{self.rank}.pt", capture_rng())
        # an upload of the RNG file waits for the background write, off the loop
        uploads_later = is_remote(tmp) and self.mode is not AsyncMode.DISABLED
        try:
            if not uploads_later:
                rng.write()
        except (OSError, RuntimeError) as exc:  # torch reports a failed write as RuntimeError
            error = failure_cause(exc, tmp)
        # agreed before DCP's collectives: no rank enters them alone
        if error := self._agree(error, step):
            raise self._fail(step, tmp, error)
        try:
            future, shards = self._write(state, tmp)
        except (Exception, CheckpointException) as exc:  # DCP reports all ranks' failures
            error = failure_cause(exc, tmp)
            # and where its own collectives failed (a peer died), so does this agreement
            self._agree(error, step)
            raise self._fail(step, tmp, error) from None
        if future is not None:  # checksum this rank's files in the background, once written
            later = rng if uploads_later else None
            future = self._background().submit(written_checksums, future, tmp, self.rank, later)
        blocked = time.perf_counter() - started
        self.pending = PendingSave(step, tmp, train_state, future, shards, started, blocked)
        if self.mode is AsyncMode.DISABLED:
            self.wait()

    def _write(
        self, state: dict[str, Any], tmp: CheckpointPath
    ) -> tuple[Future | None, Callable[[], Mapping[str, list]]]:
        """DCP's write of ``state`` into ``tmp``: synchronous, returning how to get the shards'
        checksums (computed as they were written where the storage allows, else read back in
        ``wait``, where every rank agrees on a failure), or started in the background,
        returning its future."""
        if self.mode is not AsyncMode.DISABLED and not dist.is_initialized():
            ignore_single_process_warning()  # DCP's thread may warn once the block has ended
        with single_process_dcp():
            if self.mode is AsyncMode.DISABLED:
                writer = self.storage.writer(tmp, self._piece_pool())
                dcp_save(state, storage_writer=writer, process_group=self.group)
                return None, written_shards(writer)
            result = async_save(
                state,
                storage_writer=self.storage.writer(tmp, None),
                process_group=self.group,
                async_checkpointer_type=self._executor_type,
                async_stager=self.stager,
            )
            return (result if isinstance(result, Future) else result.upload_completion), dict

    def wait(self) -> CheckpointPath | None:
        """Finish and commit the save in flight, if any; returns the committed path. A failed
        write raises ``CheckpointSaveError`` on every rank (nothing is committed)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        waited = time.perf_counter()
        error, sums, gave_up = None, {}, False
        try:  # the write and this rank's checksums of it, fresh in the page cache
            if pending.future is not None:
                sums = result_while_answering(pending.future, self.root)
            else:  # the shards' checksums came with the write; the small files' now
                shards = pending.shards()
                rest = [f for f in own_files(pending.tmp, self.rank) if f not in shards]
                sums = {**shards, **checksums_of(pending.tmp, rest)}
        except (Exception, CheckpointException) as exc:
            error = failure_cause(exc, pending.tmp)
            # given up on while the write still runs (not a bounded call of its own that
            # timed out: then nothing is left running)
            running = pending.future is not None and not pending.future.done()
            gave_up = isinstance(exc, StoreTimeoutError) and running
        # every rank's shards are written and checksummed, or none commits
        checksums, error, gave_up = self._merged(sums, error, gave_up, pending.step)
        if error:
            raise self._fail(pending.step, pending.tmp, error, abandoned=gave_up)
        final = step_dir(self.root, pending.step)
        if self.rank == 0:
            try:
                commit_checkpoint(
                    self.root, pending.tmp, pending.step, pending.train_state, checksums
                )
            except OSError as exc:
                error = failure_cause(exc, pending.tmp)
        if error := self._agree(error, pending.step):
            raise self._fail(pending.step, pending.tmp, error)
        committed = time.perf_counter()
        size = sum(int(entry[0]) for entry in checksums.values())
        held = pending.blocked_s + committed - waited
        self.costs.append(SaveCost(pending.step, held, committed - pending.started, size))
        self._newest = max(self._newest if self._newest is not None else -1, pending.step)
        self._committed = pending.step  # ``latest`` names it
        if self.rank == 0:
            self.on_commit(pending.step, final)
        self._agree(None, pending.step)  # retention and hooks are done before any rank goes on
        return final

    @property
    def _executor_type(self) -> AsyncCheckpointerType:
        if self.mode is AsyncMode.ASYNC_PROCESS:
            return AsyncCheckpointerType.PROCESS
        return AsyncCheckpointerType.THREAD

    def _background(self) -> ThreadPoolExecutor:
        """The thread that checksums an async save once its write completes."""
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forge-checksum")
        return self._hasher

    def stop_threads(self, wait: bool = True) -> None:
        """Shut the checksum threads down (after a fatal failure too: none is left running;
        ``wait=False`` after a save given up on, whose checksum thread waits on its write)."""
        for pool in (self._hasher, self._pieces):
            if pool is not None:
                pool.shutdown(wait=wait, cancel_futures=not wait)
        self._hasher = self._pieces = None

    def _piece_pool(self) -> ThreadPoolExecutor:
        """The threads that checksum a synchronous save's shard pieces as they are written."""
        if self._pieces is None:
            self._pieces = hashing_pool()
        return self._pieces

    def close(self) -> None:
        """Commit the save in flight, stop the checkpoint process and release staging buffers."""
        self.wait()
        self.stop_threads()
        if self.mode is AsyncMode.ASYNC_PROCESS:
            stop_checkpoint_process()
        self.stager.close()
        if self._owns_default_group:
            dist.destroy_process_group()
            self._owns_default_group = False

    def status(self) -> tuple[bool, bool]:
        """Whether a save is in flight, and whether this rank has written it (its commit then
        needs no wait here)."""
        pending = self.pending
        if pending is None:
            return False, True
        return True, pending.future is None or pending.future.done()

    @property
    def in_flight(self) -> int | None:
        """The step being written, if any."""
        return self.pending.step if self.pending else None


@torch.no_grad()
def nonfinite_parameter(model: nn.Module) -> str | None:
    """A line naming this rank's first parameter (its local shard) holding NaN or infinity,
    else None: one device-to-host read for the whole model. Each parameter's sum is
    non-finite when it holds a NaN or an infinity (or, for finite values, only beyond 3e38,
    which ``isfinite`` then rules out)."""
    named = [
        (n, p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()
    ]
    if not named:
        return None
    sums = torch.stack([p.sum().float() for _, p in named]).isfinite().tolist()
    for (name, p), finite in zip(named, sums, strict=True):
        if not finite and not bool(torch.isfinite(p).all()):
            return (
                f"the weights are not finite ({canonical_name(name)} holds NaN or infinity): not "
                "saved, so the last checkpoint stays the newest good one"
            )
    return None


def save_checkpoint(
    root: CheckpointPath,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    *,
    rank: int = 0,
) -> CheckpointPath:
    """Write ``step_<step>`` synchronously, in one process; returns its path. (Training uses
    ``Checkpointer``, which also handles many ranks and async saves.)"""
    writer = Checkpointer(root, AsyncMode.DISABLED, rank, world_size=1)
    try:
        writer.save(step, model, optimizer, train_state)
    finally:
        writer.close()
    return step_dir(root, step)
