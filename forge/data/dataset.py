"""Fixed-length training windows over memory-mapped token shards."""

from __future__ import annotations

import pathlib

import numpy as np

from forge.data.shards import DataError, Manifest, open_split


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs plus the shifted labels).

    Window ``i`` never crosses a shard boundary; the last token of one window is the first of
    the next, so every token is predicted once per epoch.
    """

    def __init__(self, shards: list[np.ndarray], seq_len: int) -> None:
        self.seq_len = seq_len
        self.shards = shards
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self._starts = np.cumsum([0, *counts])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        offset = (index - int(self._starts[shard])) * self.seq_len
        return np.asarray(self.shards[shard][offset : offset + self.seq_len + 1])


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
