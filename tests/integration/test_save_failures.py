"""A failed save says what it found, not what it assumes: a write that found no space is
named for it (every shape the error takes on its way up), and the previous checkpoint and
``latest`` are called intact only once checked through the storage (a disk, an object
store) — otherwise the line names what is gone."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import NamedTuple

import pytest
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from forge.checkpoint.checkpointer import Checkpointer
from forge.checkpoint.paths import CheckpointPath, location
from forge.checkpoint.storage import LATEST, ObjectStorage, PosixStorage
from forge.config.sections import AsyncMode
from forge.errors import CheckpointSaveError
from tests.integration.test_checkpoint_integrity import model_and_optimizer, train_state

TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def short_write_after(cause: OSError | None) -> RuntimeError:
    """torch's zip writer's error, raised while handling ``cause`` (as when its stream's write
    failed) or alone (a file torch opened itself, or an error sent from another process)."""
    if cause is None:
        return RuntimeError(TORCH_SHORT_WRITE)
    try:
        try:
            raise cause
        except OSError:  # torch keeps it as the context, not the cause
            raise RuntimeError(TORCH_SHORT_WRITE)  # noqa: B904
    except RuntimeError as exc:
        return exc


class Shape(NamedTuple):
    name: str
    error: Callable[[], BaseException]
    free_bytes: int  # what the disk that holds the checkpoint reports free
    no_space: bool  # the line names the lack of space


GiB = 1 << 30
SHAPES = [
    Shape("OSError ENOSPC", enospc, 10 * GiB, True),
    Shape("OSError EDQUOT (quota spent)", lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), 10 * GiB, True),
    Shape("torch's short write, ENOSPC its context", lambda: short_write_after(enospc()), 10 * GiB, True),
    Shape("torch's short write alone, the disk full", lambda: short_write_after(None), 4096, True),
    Shape("torch's short write alone, the disk with room", lambda: short_write_after(None), 10 * GiB, False),
    Shape("another OSError (EIO), the disk full", lambda: OSError(errno.EIO, "Input/output error"), 0, False),
]  # fmt: skip


class FailingWriter(FileSystemWriter):
    """DCP's writer whose every shard write fails with ``error`` (DCP reports it per rank)."""

    def __init__(self, path: pathlib.Path, error: BaseException) -> None:
        super().__init__(path)
        self.error = error

    def write_data(self, plan, planner):
        raise self.error


class FreeSpace(NamedTuple):
    total: int
    used: int
    free: int


def failed_save(root: CheckpointPath, step: int = 2, mode: AsyncMode = AsyncMode.DISABLED) -> str:
    """The message of a save of ``step`` into ``root`` that fails (the writer is patched by
    the caller)."""
    model, opt = model_and_optimizer()
    ck = Checkpointer(root, mode, 0, 1)
    try:
        with pytest.raises(CheckpointSaveError) as failed:
            ck.save(step, model, opt, train_state(step))
            ck.wait()
    finally:
        ck.close()
    return str(failed.value)


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_a_save_that_found_no_space_is_named_for_it(tmp_path, monkeypatch, shape):
    monkeypatch.setattr(
        PosixStorage, "writer", lambda self, staging, pool: FailingWriter(staging, shape.error())
    )
    monkeypatch.setattr(shutil, "disk_usage", lambda path: FreeSpace(GiB, 0, shape.free_bytes))
    root = tmp_path / "checkpoints"
    line = failed_save(root)
    assert line.startswith(f"checkpoint.dir {root}: saving step 2 failed ("), line
    named = "no space left on the device" in line and f"free space on the disk that holds {root}"
    assert bool(named and named in line) is shape.no_space, line
    assert "rank 0: " in line  # the cause itself stays in the line
    assert not (root / "step_2.tmp").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("mode", [AsyncMode.DISABLED, AsyncMode.ASYNC], ids=lambda m: m.value)
def test_a_real_enospc_through_torch_writer_is_named(tmp_path, mode):
    """The shard file is /dev/full, where every write fails with ENOSPC: DCP's real writer,
    torch's zip writer on its stream, the real error chain."""
    root = tmp_path / "checkpoints"
    prepare = PosixStorage.prepare

    def shards_to_dev_full(self, root_, staging, fresh=False):
        prepare(self, root_, staging, fresh)
        (staging / "__0_0.distcp").symlink_to("/dev/full")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PosixStorage, "prepare", shards_to_dev_full)
        line = failed_save(root, mode=mode)
    assert "unexpected pos" in line or "No space left on device" in line, line
    assert "no space left on the device" in line and "free space on the disk" in line, line


class Loss(NamedTuple):
    name: str
    lose: Callable[[CheckpointPath], None]  # what the store loses after step 1's commit
    says: tuple[str, ...]  # what the failed save's line says of it


def remove(path: CheckpointPath) -> None:
    if isinstance(path, pathlib.Path):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    else:
        path.remove_tree() if path.is_dir() else path.unlink()


def empty(root: CheckpointPath) -> None:
    remove(root / "step_1")
    remove(root / LATEST)


LOSSES = [
    Loss("nothing lost", lambda root: None, ("the previous checkpoint (step_1) and 'latest' are intact",)),
    Loss("the previous step deleted", lambda root: remove(root / "step_1"),
         ("the previous checkpoint step_1 is gone (deleted, or lost by the store)",)),
    Loss("the prefix emptied", empty,
         ("the previous checkpoint step_1 and 'latest' are gone (deleted, or lost by the store)",)),
]  # fmt: skip


@pytest.fixture(params=["disk", "object store"])
def root(request, tmp_path) -> CheckpointPath:
    if request.param == "disk":
        return tmp_path / "checkpoints"
    bucket = request.getfixturevalue("s3_bucket")
    return location(f"s3://{bucket}/run")


@pytest.mark.parametrize("loss", LOSSES, ids=[x.name for x in LOSSES])
def test_intact_is_said_only_once_checked(root, monkeypatch, loss):
    model, opt = model_and_optimizer()
    ck = Checkpointer(root, AsyncMode.DISABLED, 0, 1)
    try:
        ck.save(1, model, opt, train_state(1))
        loss.lose(root)

        def broken(self, staging, pool):
            raise OSError(errno.EIO, "Input/output error")

        storage = PosixStorage if isinstance(root, pathlib.Path) else ObjectStorage
        monkeypatch.setattr(storage, "writer", broken)
        with pytest.raises(CheckpointSaveError) as failed:
            ck.save(2, model, opt, train_state(2))
    finally:
        ck.close()
    line = str(failed.value)
    assert all(s in line for s in loss.says), line
    assert ("are intact" in line) is (loss.name == "nothing lost"), line


def test_a_first_save_that_fails_claims_no_earlier_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(
        PosixStorage, "writer", lambda self, staging, pool: FailingWriter(staging, enospc())
    )
    line = failed_save(tmp_path / "checkpoints", step=1)
    assert line.endswith("; no earlier checkpoint of this run was committed"), line
