"""A stateful batch loader that resumes by seeking, never by replaying."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import torch

from forge.data.dataset import TokenWindows
from forge.data.sampler import epoch_permutation


@attrs.frozen
class Batch:
    """One micro-batch: ``labels`` is ``inputs`` shifted left by one token."""

    inputs: torch.Tensor
    labels: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.labels.numel()


@attrs.frozen
class LoaderPosition:
    """Where the next batch comes from: its epoch and batch index within the epoch."""

    epoch: int = 0
    batch: int = 0


class TextLoader:
    """Yields micro-batches of shuffled windows; each data-parallel rank takes its own slice.

    Its whole state is a ``LoaderPosition``: ``load_state_dict`` seeks there in O(1).
    With ``max_epochs`` set, iteration stops when that many epochs are consumed. Batches are
    placed on ``device`` (the training device).
    """

    def __init__(
        self,
        windows: TokenWindows,
        batch_size: int,
        seed: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        max_epochs: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.windows = windows
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.max_epochs = max_epochs
        self.batches_per_epoch = len(windows) // (batch_size * world_size)
        self.position = LoaderPosition()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        pos = self.position
        if pos.batch >= self.batches_per_epoch:
            pos = LoaderPosition(epoch=pos.epoch + 1, batch=0)
        if self.batches_per_epoch == 0 or (
            self.max_epochs is not None and pos.epoch >= self.max_epochs
        ):
            self.position = pos
            raise StopIteration
        perm = epoch_permutation(self.seed, pos.epoch, len(self.windows))
        first = (pos.batch * self.world_size + self.rank) * self.batch_size
        rows = np.stack([self.windows[int(i)] for i in perm[first : first + self.batch_size]])
        tokens = torch.from_numpy(rows.astype(np.int64)).to(self.device, non_blocking=True)
        self.position = LoaderPosition(epoch=pos.epoch, batch=pos.batch + 1)
        return Batch(inputs=tokens[:, :-1], labels=tokens[:, 1:])

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position of the next batch."""
        return {"epoch": self.position.epoch, "batch": self.position.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to a position saved by ``state_dict``."""
        self.position = LoaderPosition(epoch=int(state["epoch"]), batch=int(state["batch"]))


def step_batches(loader: Iterator[Batch], micro_batches: int) -> Iterator[tuple[Batch, ...]]:
    """Group micro-batches into optimizer steps; a partial group at the end is dropped."""
    while True:
        group = []
        for _ in range(micro_batches):
            try:
                group.append(next(loader))
            except StopIteration:
                return
        yield tuple(group)
