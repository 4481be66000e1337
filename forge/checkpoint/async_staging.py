"""What the async save modes need around torch's: a staging copy that reuses its buffers, and
torch's checkpoint process (``async_mode = "async_process"``) started at set-up with its log
in a file, in a session of its own, and stopped explicitly."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pathlib
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor
from torch.utils._pytree import KeyPath, keystr, tree_map_with_path

# the signals a rank outlives to make its emergency save (forge.resilience.signals'
# SHUTDOWN_SIGNALS: this floor cannot import it)
SURVIVED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
PARENT_POLL_S = 0.25  # how soon a checkpoint process notices that its rank died


def pinned_staging(source_device: str, cuda_available: bool) -> bool:
    """Whether a staging buffer is page-locked: for a tensor on a GPU, so that the copy out of
    it is asynchronous and at full bandwidth (a CPU tensor's copy is a memcpy either way)."""
    return source_device == "cuda" and cuda_available


def host_buffer(
    shape: torch.Size, dtype: torch.dtype, *, shared: bool, pinned: bool
) -> torch.Tensor:
    """A CPU buffer for staging: in shared memory with ``shared`` (torch's checkpoint process
    reads it in place), page-locked with ``pinned`` (shared memory is registered with CUDA
    and unregistered when the buffer is freed)."""
    buffer = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned and not shared)
    if shared:
        buffer.share_memory_()
        if pinned and buffer.numel() > 0:
            register_with_cuda(buffer)
    return buffer


def register_with_cuda(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer``'s memory for CUDA (unregistered when it is freed); False, the
    buffer left pageable, where the system refuses (a memlock limit, a sandbox)."""
    cudart = torch.cuda.cudart()
    assert cudart is not None, "pinned staging needs CUDA"
    size = buffer.numel() * buffer.element_size()
    if int(cudart.cudaHostRegister(buffer.data_ptr(), size, 1)) != 0:  # 1: portable, as torch's
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:  # else a later kernel launch's check reports this error
            clear()
        return False
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return True


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
        self._pending_copies = False  # non-blocking device-to-host copies not yet waited for
        self._said_unpinned = False  # a refused page-lock is reported once

    def _copy(self, key: str, source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        pinned = pinned_staging(source.device.type, torch.cuda.is_available())
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = host_buffer(source.shape, source.dtype, shared=self.shared, pinned=pinned)
            self._buffers[key] = buffer
            if pinned and buffer.numel() and not buffer.is_pinned() and not self._said_unpinned:
                self._said_unpinned = True
                print(
                    "[forge] warning: the system refused to page-lock the checkpoint staging "
                    "buffers (a memlock limit?): saves stage through pageable memory, slower",
                    file=sys.stderr,
                )
        self._pending_copies |= pinned
        return buffer.copy_(source.detach(), non_blocking=pinned)

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
        """A private CPU copy of ``state_dict``'s tensors, complete when this returns."""
        staged = tree_map_with_path(self._stage, state_dict)
        if self._pending_copies:  # the copies overlap each other; the next step waits for all
            torch.cuda.current_stream().synchronize()
            self._pending_copies = False
        return staged

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Release the buffers."""
        self._buffers.clear()


TERMINATED_S = 5.0  # a terminated checkpoint process's exit, waited for (it is not written to)


def stop_checkpoint_process(grace_s: float = 30.0) -> None:
    """Stop torch's checkpoint daemon process, if one was started: asked to end, given
    ``grace_s`` to finish what it writes, then terminated (``grace_s=0``: a save given up on,
    whose write — into a store that stopped answering, say — nothing waits for).

    torch keeps it in a module global and stops it only in ``__del__``, which never runs when
    the script ends with ``os._exit``; the daemon would then die on a broken pipe, noisily.
    """
    process = _async_process_executor._CHECKPOINT_PROCESS
    _async_process_executor._CHECKPOINT_PROCESS = None
    if process is not None and process._save_process.is_alive():
        process._send(_async_process_executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process._save_process.join(timeout=grace_s)
        if process._save_process.is_alive():
            process._save_process.terminate()
            process._save_process.join(timeout=TERMINATED_S)


@contextmanager
def stderr_to(log: pathlib.Path) -> Iterator[None]:
    """Point file descriptor 2 at ``log`` inside the block (a process started there keeps it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with log.open("ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def gloo_group(timeout_s: float) -> dist.ProcessGroup:
    """A new gloo group of every rank (every rank calls it, in the same order): collectives
    of their own, beside the training's (DCP's, the ranks' agreements on a save), each
    bounded by ``timeout_s`` (``distributed.timeout_s``: a group made without one waits 30
    minutes for a stalled peer, whatever the default group's timeout)."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    assert isinstance(group, dist.ProcessGroup)
    return group


def start_checkpoint_process(group: dist.ProcessGroup | None, log: pathlib.Path) -> None:
    """Start torch's checkpoint process now, with its output going to ``log``, in a session
    of its own (``OwnSessionCheckpointProcess``).

    torch would start it inside the first ``async_save``, from a background thread, writing
    its log (a full traceback for every failed write) to the trainer's stderr, where forge
    reports such a failure in one line. Starting it here, at set-up, also keeps the spawn out
    of the first save. Collective: every rank calls it.
    """
    executor = _async_process_executor
    if executor._CHECKPOINT_PROCESS is not None:
        return
    init_info = executor._ProcessGroupInitInfo(group)
    # blocked until the child has left the group: a signal to the group in the seconds its
    # start takes stays pending here (handled once unblocked) and is dropped there
    with stderr_to(log), signals_blocked(SURVIVED):
        executor._CHECKPOINT_PROCESS = OwnSessionCheckpointProcess(pg_init_info=init_info)


@contextmanager
def signals_blocked(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """Block ``signals`` in this thread inside the block; a process started there inherits the
    mask. One that arrives meanwhile is delivered when the block ends, not lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class OwnSessionCheckpointProcess(_async_process_executor._AsyncCheckpointProcess):
    """torch's checkpoint process, out of its rank's process group.

    A launcher, a scheduler or a terminal signals a job's whole process group (torchrun's
    shutdown, Ctrl-C): in the group, the checkpoint process died with the signal that asks
    its rank for an emergency save, and that save, the one in flight and the one awaiting
    its commit failed. In a session of its own it receives no signal meant for the group;
    its rank stops it (``stop_checkpoint_process``), and it ends itself within
    ``PARENT_POLL_S`` of its rank's death (SIGKILL included), so it never outlives the rank
    for long.
    """

    @staticmethod
    def _checkpointing_subprocess(pg_init_info: Any, parent_conn: Any) -> None:
        rank = leave_the_process_group()
        quiet_when_orphaned(
            lambda: _async_process_executor._AsyncCheckpointProcess._checkpointing_subprocess(
                pg_init_info, parent_conn
            ),
            rank,
        )


def quiet_when_orphaned(serve: Callable[[], None], rank: int) -> None:
    """``serve()``, which reads its rank's requests through a pipe: when the rank dies, the
    pipe breaks in the middle of a read (a request's tensors half sent) — one line for the
    process's log then, not a traceback; an error while the rank lives is raised."""
    try:
        serve()
    except (EOFError, OSError) as exc:
        if not orphaned(rank):
            raise
        print(
            f"[forge] checkpoint process {os.getpid()}: its rank process {rank} is gone "
            f"({type(exc).__name__} on its pipe); exiting",
            file=sys.stderr,
            flush=True,
        )


def orphaned(rank: int, wait_s: float = 1.0) -> bool:
    """Whether this process's parent ``rank`` has died (it is reparented), waiting up to
    ``wait_s``: a dying process closes its pipes before its children are reparented."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == rank:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def leave_the_process_group() -> int:
    """In the checkpoint process, before anything else of its own: a session of its own, the
    signals its rank blocked while starting it dropped (they were meant for the rank) and
    their usual handling back, and a thread that ends this process once its rank is gone.
    Returns the rank's pid."""
    os.setsid()
    for sig in SURVIVED:  # ignoring a blocked signal discards it if pending
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SURVIVED)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    # the pid its rank recorded when it started it (spawn starts it from the rank directly;
    # getppid alone would miss a rank that died during these seconds of start-up)
    parent = multiprocessing.parent_process()
    rank = parent.pid if parent is not None and parent.pid is not None else os.getppid()
    print(f"[forge] checkpoint process {os.getpid()} of rank process {rank}", file=sys.stderr)
    watch = threading.Thread(target=exit_after, args=(rank,), name="forge-rank-watch")
    watch.daemon = True
    watch.start()
    return rank


def exit_after(parent: int) -> None:
    """End this process once ``parent`` has died (this process is then reparented): a save it
    is writing can no longer be committed, and its peers' collectives fail instead of
    waiting out their timeout."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)
