"""Fixed-length training windows over memory-mapped token shards."""

from __future__ import annotations

import numpy as np


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
