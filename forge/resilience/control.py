"""The per-step control word: one small all-reduce so that every rank takes the same branch.

Each rank contributes its own flags (non-finite step, shutdown requested, health failure, a
replayed step without a majority); the MAX over ranks is what every decision reads. The
exchange runs on its own gloo group with a short timeout, which makes it the liveness check
too: a stalled or dead peer turns into ``health_failed`` instead of a hang.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from forge.types import Signals, StepResult

FIELDS = (
    "nonfinite",
    "shutdown_requested",
    "health_failed",
    "replay_failed",
    "float8_stopped",
    "save_unwritten",
)


def encode(local: Signals) -> list[float]:
    """The flags as numbers, in ``FIELDS`` order."""
    return [float(getattr(local, f)) for f in FIELDS]


def decode(values: list[float]) -> Signals:
    """The reduced word back as ``Signals``."""
    return Signals(**{f: v > 0 for f, v in zip(FIELDS, values, strict=True)})


class ControlChannel:
    """Reduces ``Signals`` over every rank (identity in a single process)."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.group = None
        if world_size > 1:
            self.group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
        self.failed = False

    def exchange(self, local: Signals) -> Signals:
        """The MAX of every rank's flags; a timeout or a broken peer reads as a health failure."""
        if self.group is None:
            return local
        if self.failed:
            return Signals(health_failed=True)
        word = torch.tensor(encode(local))
        try:
            dist.all_reduce(word, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError:
            self.failed = True
            return Signals(health_failed=True)
        return decode(word.tolist())

    def steps_agree(self, step: int) -> bool:
        """Liveness and agreement: every rank is at ``step``. False on timeout or mismatch."""
        if self.group is None:
            return True
        if self.failed:
            return False
        pair = torch.tensor([float(step), -float(step)])
        try:
            dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError:
            self.failed = True
            return False
        return pair[0].item() == step and -pair[1].item() == step


class StepMonitor:
    """The loop's ``poll``: this rank's flags for the step just run, reduced over every rank,
    plus a liveness and agreement check every ``health_check_interval`` steps; and whether a
    save in flight is written on every rank (``Signals.save_written``), so that it commits at
    the next step instead of at the next save (an async save not committed is lost work)."""

    def __init__(
        self,
        channel: ControlChannel,
        shutdown: Callable[[], bool],
        health_check_interval: int,
        save: Callable[[], tuple[bool, bool]] = lambda: (False, True),
    ) -> None:
        self.channel = channel
        self.shutdown = shutdown
        self.interval = health_check_interval
        self.save = save  # (a save is in flight, this rank has written it)
        self.steps = 0  # steps run by this process; equal on every healthy rank

    def __call__(self, result: StepResult) -> Signals:
        self.steps += 1
        in_flight, written = self.save()
        word = self.channel.exchange(
            Signals(
                shutdown_requested=self.shutdown(),
                nonfinite=not result.finite,
                health_failed=result.collective_failed,
                replay_failed=result.replay is not None and result.replay.failed,
                float8_stopped=result.float8 is not None and result.float8.stops,
                save_unwritten=in_flight and not written,
            )
        )
        if in_flight and not word.save_unwritten and not word.health_failed:
            word = attrs.evolve(word, save_written=True)  # every rank's write is done
        due = self.interval > 0 and self.steps % self.interval == 0
        if due and not word.health_failed and not self.channel.steps_agree(self.steps):
            word = attrs.evolve(word, health_failed=True)
        return word
