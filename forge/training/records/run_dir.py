"""One run per run directory: an advisory lock, paths checked before training, and a fresh
start that never overwrites another run's records.

The lock is ``fcntl.flock`` on ``.forge.lock`` in the run directory (and in the checkpoint
directory when that lies elsewhere), held by rank 0 for the whole run. The OS releases it when
the process ends, however it ends, so a SIGKILLed run never leaves a stale lock; the file's
text (pid and host of the holder) only serves the error message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import socket
import stat
import time
from collections.abc import Sequence
from typing import Any

import attrs

from forge.checkpoint.object_path import ObjectPath
from forge.checkpoint.paths import CheckpointPath, location
from forge.config.loader import ConfigError, load_config
from forge.config.sections import JobConfig
from forge.errors import UserInputError
from forge.metrics.goodput import LEDGER_FILE
from forge.metrics.sinks import superseded_path
from forge.training.records.resume_rules import changes
from forge.training.records.run_record import predated_model_defaults, run_identity
from forge.training.records.run_records import COMMITS_FILE, CONFIG_FILE, config_in_force
from forge.training.setup.store_claim import Claim, StoreClaimError, claim_prefix, store_problem

LOCK_FILE = ".forge.lock"


class RunDirBusyError(UserInputError):
    """Another process holds the run (or checkpoint) directory."""


def path_problem(key: str, path: CheckpointPath) -> str | None:
    """Why ``path`` cannot be a directory this run writes into, if it cannot: it is a file, it
    lies below a file, or its nearest existing ancestor is not writable (a prefix in an object
    store: ``store_problem``)."""
    if isinstance(path, ObjectPath):
        return store_problem(key, path)
    if path.exists() and not path.is_dir():
        return f"{key}: {path} is a file, not a directory; choose another {key}"
    ancestor = path
    while not ancestor.exists():
        if ancestor.is_symlink():  # a dangling link: mkdir would fail on it
            return f"{key}: {ancestor} is a broken symbolic link; choose another {key}"
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{key}: {path} lies below the file {ancestor}; choose another {key}"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{key}: {ancestor} is not writable; choose another {key}"
    return None


# the files a launch reads and appends in run.dir (the config history's others are config.*)
RECORD_FILES = (
    CONFIG_FILE,
    "metrics.jsonl",
    superseded_path(pathlib.Path("metrics.jsonl")).name,
    COMMITS_FILE,
    LEDGER_FILE,
)


def record_file_problem(run_dir: pathlib.Path) -> str | None:
    """Why a file forge keeps its records in cannot be one, or None: it is a folder (it
    takes no lines), a FIFO or a socket (opened, it would block the launch for good). A
    device takes lines, or fails each with its own error (``/dev/full``: the disk full)."""
    for name in RECORD_FILES:
        path = run_dir / name
        try:
            mode = path.stat().st_mode
        except OSError:  # absent (or a broken link): the launch creates it, or names why not
            continue
        kind = (
            "a folder" if stat.S_ISDIR(mode)
            else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode)
            else None
        )  # fmt: skip
        if kind is not None:
            return (
                f"run.dir: {path} is {kind}, not a file: forge keeps its records there; "
                "remove it, or choose a new --run.dir"
            )
    return None


def _holder(lock_file: pathlib.Path) -> str:
    try:
        text = lock_file.read_text().strip()
    except OSError:
        return "another process"
    return text or "another process"


def holder_pid(run_dir: pathlib.Path) -> int | None:
    """The pid the run's lock file names (``pid N on host H``, written by the trainer that
    took it: rank 0), or None."""
    words = _holder(run_dir / LOCK_FILE).split()
    return int(words[1]) if len(words) > 1 and words[0] == "pid" and words[1].isdigit() else None


@attrs.define
class RunDirLock:
    """Exclusive locks on the directories a run writes; ``release`` unlocks them and, with
    ``discard``, removes the directories the lock itself created (a run that never started)."""

    files: list[object] = attrs.Factory(list)  # open lock files (their descriptors hold the lock)
    created: list[pathlib.Path] = attrs.Factory(list)  # directories and lock files made here
    claims: list[Claim] = attrs.Factory(list)  # object-store prefixes claimed here

    def release(self, discard: bool = False) -> None:
        for f in self.files:
            f.close()  # type: ignore[attr-defined]
        self.files.clear()
        if discard:
            for claim in self.claims:
                claim.withdraw()
            for path in reversed(self.created):
                with contextlib.suppress(OSError):  # a folder only if nothing else is in it
                    path.rmdir() if path.is_dir() else path.unlink()
        self.created.clear()
        self.claims.clear()


def _make_dirs(key: str, folder: pathlib.Path, lock: RunDirLock) -> None:
    missing = []
    probe = folder
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirBusyError(
            f"{key}: cannot create {folder} ({exc.strerror}); choose another {key}"
        ) from None
    lock.created += reversed(missing)


def trainer_running(run_dir: pathlib.Path) -> bool:
    """Whether a trainer holds ``run_dir`` (its lock, ``forge.training.records.run_dir``): a
    shared lock tried and given back at once. A trainer starting in that instant waits for it
    (the run lock is retried for a moment) rather than being refused."""
    path = run_dir / LOCK_FILE
    try:
        f = path.open("rb")
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return False


def take_lock(f: Any, patience_s: float = 1.0) -> bool:
    """Whether ``f``'s exclusive lock is taken: tried for ``patience_s``, so that a reader
    checking whether a trainer runs (the evaluation follower's shared lock, given back at
    once) never turns a trainer away."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def lock_directories(dirs: Sequence[tuple[str, CheckpointPath]]) -> RunDirLock:
    """Create and lock each ``(config key, directory)``; raise ``RunDirBusyError`` naming the
    directory and the holder if another process holds one (then nothing stays locked). The
    checkpoint directory (each entry after the first) is also claimed for the run directory
    (the first entry), and a prefix in an object store is claimed instead of locked
    (``store_claim``): another run directory's is refused, naming its owner."""
    run_dir = dirs[0][1]
    assert isinstance(run_dir, pathlib.Path), "the run directory is local"
    lock = RunDirLock()

    def claim(key: str, folder: CheckpointPath) -> None:
        try:
            lock.claims.append(claim_prefix(key, folder, run_dir))
        except StoreClaimError as exc:
            raise RunDirBusyError(exc.lines) from None

    try:
        for key, folder in dirs:
            if isinstance(folder, ObjectPath):
                claim(key, folder)
                continue
            _make_dirs(key, folder, lock)
            lock_file = folder / LOCK_FILE
            if not lock_file.exists():
                lock.created.append(lock_file)
            try:
                f = lock_file.open("a+")
            except OSError as exc:
                raise RunDirBusyError(
                    f"{key}: cannot write {lock_file} ({exc.strerror}); choose another {key}"
                ) from None
            if not take_lock(f):
                f.close()
                raise RunDirBusyError(
                    f"{key}: {folder} is in use by {_holder(lock_file)}; wait for that run to "
                    f"end, or choose another {key}"
                ) from None
            # a forked child (a DataLoader worker) would share the lock and could hold it after
            # this process is gone: children close their copy
            os.register_at_fork(after_in_child=f.close)
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
            f.flush()
            lock.files.append(f)
            if folder != run_dir:
                claim(key, folder)
    except BaseException:
        lock.release(discard=True)
        raise
    return lock


def checkpoint_dir_of(config: JobConfig, run_dir: pathlib.Path) -> CheckpointPath:
    """``checkpoint.dir`` (a local path or an object-store URL), or ``<run.dir>/checkpoints``
    when unset."""
    cfg = config.checkpoint
    if not cfg.dir:
        return run_dir / "checkpoints"
    where = location(cfg.dir, cfg.storage_options, cfg.storage_timeout_s)
    ft = config.fault_tolerance
    return where / group_dir(ft.group) if ft.enabled else where


def group_dir(group: int) -> str:
    """The folder of replica group ``group`` under the run directory and ``checkpoint.dir``
    (``[fault_tolerance]``): each group keeps its own records and checkpoints."""
    return f"group_{group}"


def groups_switch_problem(base: pathlib.Path, enabled: bool) -> str | None:
    """Why ``run.dir`` (``base``) cannot take this launch: it holds a run trained the other
    way (with replica groups, each keeps its records under ``group_<N>/``), which this one
    would not resume but start afresh beside; None when it does not."""
    groups = sorted(p.name for p in base.glob("group_*") if holds_a_run(p))
    if enabled and holds_a_run(base):
        return (
            f"fault_tolerance.enabled: {base} holds a run trained without replica groups; "
            "with them each group keeps its own records under group_<N>/ and would start "
            "afresh beside it: resume it without fault_tolerance, or choose a new --run.dir"
        )
    if not enabled and groups:
        return (
            f"fault_tolerance.enabled: {base} holds the runs of replica groups "
            f"({', '.join(groups)}); a launch without them would start afresh beside them: "
            "set fault_tolerance.enabled = true (with its group), or choose a new --run.dir"
        )
    return None


def holds_a_run(folder: pathlib.Path) -> bool:
    """Whether a run has started in ``folder``: its config is written first, before its
    records (a set-up that fails leaves no folder at all)."""
    return any((folder / name).is_file() for name in (CONFIG_FILE, "metrics.jsonl"))


def load_path_of(config: JobConfig) -> CheckpointPath | None:
    """``checkpoint.load_path`` (a local path or an object-store URL), if set."""
    cfg = config.checkpoint
    if not cfg.load_path:
        return None
    return location(cfg.load_path, cfg.storage_options, cfg.storage_timeout_s)


def foreign_records_problem(
    run_dir: pathlib.Path, checkpoint_dir: CheckpointPath, config: JobConfig
) -> str | None:
    """Why a fresh start (no checkpoint to resume) must not write into ``run_dir``: it holds
    the records of another run (a different checkpoint directory or model / data order).
    The same run restarting after a crash before its first checkpoint is allowed."""
    config_file, metrics = config_in_force(run_dir), run_dir / "metrics.jsonl"
    fix = f"choose a new --run.dir, or delete {run_dir} to start over"
    if config_file is None:
        if metrics.is_file() and metrics.stat().st_size > 0:
            return f"run.dir: {run_dir} holds metrics.jsonl of an unknown run; {fix}"
        return None
    try:
        previous = load_config([str(config_file)]).config
    except ConfigError:
        unreadable = f"an unreadable {config_file.name}"
        return f"run.dir: {run_dir} holds another run's records ({unreadable}); {fix}"
    previous_ckpt = checkpoint_dir_of(previous, run_dir)
    if previous_ckpt.resolve() != checkpoint_dir.resolve():
        return (
            f"run.dir: {run_dir} holds the records of a run whose checkpoints are in "
            f"{previous_ckpt}, and {checkpoint_dir} has none to resume; {fix}"
        )
    found = changes(
        run_identity(previous, None), run_identity(config, None), predated_model_defaults()
    )
    if found:
        return (
            f"run.dir: {run_dir} holds the records of another run ({found[0].describe()}, "
            f"its config's → this one's) and no checkpoint to resume; {fix}"
        )
    return None


def load_run_config(run_dir: pathlib.Path) -> JobConfig:
    """The resolved config a run last trained under (``config.toml``, or the newest
    ``config.step_N.toml`` a resume with changes wrote)."""
    path = config_in_force(run_dir)
    if path is None:
        raise UserInputError(
            f"no forge run at {run_dir} (no config.toml); pass the run.dir of a training run"
        )
    return load_config([str(path)]).config
