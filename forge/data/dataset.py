"""Fixed-length training windows over memory-mapped token shards."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np

from forge.data.shards import DataError, Manifest, open_split


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs plus the shifted labels).

    Window ``i`` never crosses a shard boundary; the last token of one window is the first of
    the next, so every token is predicted once per epoch.
    """

    def __init__(self, shards: list[np.ndarray], seq_len: int) -> None:
        self.seq_len = seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self._starts = np.cumsum([0, *counts])
        self._first = self._starts.tolist()  # each shard's first window, as Python integers
        # plain views of the mapped shards (the only reference kept): slicing a memmap makes a
        # memmap each time
        self._arrays = [np.asarray(s) for s in shards]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def stack(self, indices: Sequence[int]) -> np.ndarray:
        """Windows ``indices`` as one array ``(len(indices), seq_len + 1)``: their shards found
        in one search, each copied straight into the result."""
        at = list(indices)
        if at and (min(at) < 0 or max(at) >= len(self)):
            raise IndexError(indices)
        shards = (np.searchsorted(self._starts, at, side="right") - 1).tolist()
        span = self.seq_len + 1
        out = np.empty((len(at), span), dtype=self._arrays[0].dtype if self._arrays else np.int64)
        for row, (index, shard) in enumerate(zip(at, shards, strict=True)):
            offset = (index - self._first[shard]) * self.seq_len
            out[row] = self._arrays[shard][offset : offset + span]
        return out

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.stack([index])[0]


def open_windows(
    folder: pathlib.Path, manifest: Manifest, split: str, seq_len: int, verify: bool
) -> TokenWindows:
    """Windows over every shard of ``split``. A shard shorter than one window (it would be
    skipped silently) is a ``DataError`` (``open_split`` refuses ids beyond the vocab)."""
    shards = open_split(folder, manifest, split, verify)
    for info, shard in zip(manifest.splits[split].shards, shards, strict=True):
        if len(shard) < seq_len + 1:
            raise DataError(
                f"{folder / info.file}: holds {len(shard)} tokens, fewer than one sequence "
                f"(train.seq_len + 1 = {seq_len + 1}); re-prepare with larger shards or lower "
                "train.seq_len"
            )
    return TokenWindows(shards, seq_len)
