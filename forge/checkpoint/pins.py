"""Pins: a reader outside the training (``scripts/eval_follow.py``) keeps retention off a
checkpoint while it reads it. Everything lives in ``<checkpoint dir>/pins/``, on a disk or in an
object store alike, so the rule holds wherever checkpoints do.

- A reader **pins** step N (``step_<N>.<holder>.pin``, holding when the pin expires), then
  checks that retention is not already removing it (no ``step_<N>.retiring``), then reads. It
  renews the pin while it reads and removes it when done.
- Retention, before it removes step N, writes ``step_<N>.retiring``, then lists the pins. A
  live pin defers the removal: ``step_<N>.deferred`` records it and the marker goes; an
  expired pin (its reader was killed) is taken away and does not count.

Each side writes first and reads the other's mark second, so at least one sees the other: the
reader sees the marker (and gives the step up, recorded as removed) or retention sees the pin
(and keeps the step). A deferred step is removed by the next retention pass, or by the reader
itself once it unpins (``finish_deferred``), so a pin delays retention, never blocks it: a
killed reader's pin counts until it expires, no longer.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from forge.checkpoint.paths import CheckpointPath, write_atomically
from forge.checkpoint.storage import step_dir, storage_of

PINS = "pins"
RETIRING = "retiring"  # retention is removing the step
DEFERRED = "deferred"  # retention wanted the step gone but a pin kept it
_PIN = re.compile(r"^step_(\d+)\.([A-Za-z0-9_-]+)\.pin$")


@attrs.frozen
class Pin:
    """One reader's pin on ``step``, live until ``expires`` (seconds since the epoch)."""

    step: int
    holder: str
    expires: float
    path: Any = attrs.field(eq=False, default=None)  # where it lies (CheckpointPath)

    def live(self, now: float) -> bool:
        return now < self.expires


def pin_path(root: CheckpointPath, step: int, holder: str) -> CheckpointPath:
    return root / PINS / f"step_{step}.{holder}.pin"


def marker_path(root: CheckpointPath, step: int, kind: str) -> CheckpointPath:
    return root / PINS / f"step_{step}.{kind}"


def parse_pin(name: str, text: str) -> Pin | None:
    """The pin a file of ``name`` holding ``text`` is; None for another name or damaged text
    (a damaged pin cannot say when it ends: it does not count)."""
    m = _PIN.match(name)
    if m is None:
        return None
    try:
        expires = json.loads(text)["expires"]
    except (ValueError, KeyError, TypeError):
        return None
    if type(expires) not in (int, float) or not math.isfinite(expires):
        return None  # an endless pin would block retention: it does not count
    return Pin(int(m.group(1)), m.group(2), float(expires))


def write_pin(root: CheckpointPath, step: int, holder: str, expires: float) -> CheckpointPath:
    """Pin ``step`` for ``holder`` until ``expires`` (written whole: a renewal replaces it)."""
    path = pin_path(root, step, holder)
    text = json.dumps({"step": step, "holder": holder, "expires": expires, "host": HOST})
    write_mark(path, text.encode())
    return path


def write_mark(path: CheckpointPath, data: bytes) -> None:
    """A pin or marker written whole, its folder made first (retention removes the folder
    when it is left empty: made again if that happened in between)."""
    for attempt in range(3):
        try:
            # ``mkdir(exist_ok=True)`` raises FileExistsError when the folder it found is
            # removed before it checks that it is a folder: retention's ``tidy`` in between
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, data)
            return
        except (FileNotFoundError, FileExistsError):
            if attempt == 2:
                raise
        except OSError as exc:  # a full disk: nothing half-written left, the file named
            if isinstance(path, pathlib.Path):
                path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc


def tidy(root: CheckpointPath) -> None:
    """Remove the pins folder of a disk when nothing is in it (a checkpoint directory that
    no reader pins looks as it always did); in use, it stays."""
    folder = root / PINS
    if isinstance(folder, pathlib.Path):
        with contextlib.suppress(OSError):
            folder.rmdir()


HOST = socket.gethostname()


def pins_of(root: CheckpointPath, step: int) -> list[Pin]:
    """Every pin on ``step`` that can be read (live or expired)."""
    folder = root / PINS
    if not folder.is_dir():
        return []
    out = []
    for path in folder.iterdir():
        if not path.name.startswith(f"step_{step}.") or not path.name.endswith(".pin"):
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):  # removed while listed, or unreadable
            continue
        pin = parse_pin(path.name, text)
        if pin is not None:
            out.append(attrs.evolve(pin, path=path))
    return out


def reclaim_pins(root: CheckpointPath, holder: str) -> list[int]:
    """Take away every pin of ``holder``'s (live or not): what a killed reader left, removed by
    the next reader of that name, which alone may hold it (one follower per run); returns
    their steps."""
    folder = root / PINS
    if not folder.is_dir():
        return []
    steps = []
    for path in folder.iterdir():
        m = _PIN.match(path.name)
        if m is not None and m.group(2) == holder:
            path.unlink(missing_ok=True)
            steps.append(int(m.group(1)))
    return sorted(steps)


def has_marker(root: CheckpointPath, step: int, kind: str) -> bool:
    return marker_path(root, step, kind).is_file()


def remove_unless_pinned(root: CheckpointPath, step: int, now: float) -> bool:
    """Retention's removal of ``step``: marked as retiring, then removed unless a live pin
    holds it (then marked deferred and kept). Expired pins are taken away. Whether removed."""
    retiring = marker_path(root, step, RETIRING)
    write_mark(retiring, b"")
    pins = pins_of(root, step)
    for pin in pins:
        if not pin.live(now):
            with contextlib.suppress(OSError):
                pin.path.unlink(missing_ok=True)
    if any(pin.live(now) for pin in pins):
        write_mark(marker_path(root, step, DEFERRED), b"")
        retiring.unlink(missing_ok=True)
        return False
    storage_of(root).remove(step_dir(root, step))
    marker_path(root, step, DEFERRED).unlink(missing_ok=True)
    retiring.unlink(missing_ok=True)
    tidy(root)
    return True


def finish_all_deferred(root: CheckpointPath, now: float) -> list[int]:
    """``finish_deferred`` for every step retention deferred (what a follower killed while it
    held a pin left, taken up by the next at its start and end); returns the removed steps."""
    folder = root / PINS
    if not folder.is_dir():
        return []
    suffix = f".{DEFERRED}"
    steps = sorted(
        int(name[5 : -len(suffix)])
        for name in (p.name for p in folder.iterdir())
        if name.startswith("step_") and name.endswith(suffix) and name[5 : -len(suffix)].isdigit()
    )
    return [step for step in steps if finish_deferred(root, step, now)]


def finish_deferred(root: CheckpointPath, step: int, now: float) -> bool:
    """After a reader unpins ``step``: the removal retention deferred for it, made now (by the
    same rule), so that a run that ended while the step was pinned does not keep it. Whether
    removed."""
    if not has_marker(root, step, DEFERRED):
        return False
    if storage_of(root).latest_target(root) == f"step_{step}":  # a rewind made it the newest
        marker_path(root, step, DEFERRED).unlink(missing_ok=True)
        return False
    return remove_unless_pinned(root, step, now)


class StepPin:
    """A held pin on one step, renewed by a thread every third of ``ttl_s`` until released;
    ``acquired`` is False when retention was already removing the step (nothing to read)."""

    def __init__(
        self,
        root: CheckpointPath,
        step: int,
        holder: str,
        ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.root, self.step, self.holder, self.ttl_s, self.clock = root, step, holder, ttl_s, clock
        self.path = write_pin(root, step, holder, clock() + ttl_s)
        self.acquired = not has_marker(root, step, RETIRING)
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="forge-pin", daemon=True)
        if self.acquired:
            self._renewer.start()
        else:
            self.path.unlink(missing_ok=True)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with contextlib.suppress(Exception):  # a missed renewal: the next one, or expiry
                write_pin(self.root, self.step, self.holder, self.clock() + self.ttl_s)

    def release(self) -> None:
        """Stop renewing and remove the pin (idempotent)."""
        self._stop.set()
        if self._renewer.is_alive():
            self._renewer.join()
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
        tidy(self.root)


@contextlib.contextmanager
def pinned(
    root: CheckpointPath, step: int, holder: str, ttl_s: float, clock: Callable[[], float]
) -> Iterator[bool]:
    """Hold a pin on ``step`` for the block; yields whether the step may be read."""
    pin = StepPin(root, step, holder, ttl_s, clock)
    try:
        yield pin.acquired
    finally:
        pin.release()
