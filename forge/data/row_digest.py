"""Sample accounting: a digest of the rows a run has consumed, to compare two runs row for row.

Each row is named by ``(global row index, source, window)`` (a window is a fixed token offset
in one shard of its source's dataset, given ``train.seq_len``) and hashed to 64 bits; a run's
digest is the sum of its rows' hashes modulo 2**64. A sum does not depend on how the rows were
grouped into micro-batches or ranks, and the row index in each hash makes it depend on their
order: two runs with equal digests at a step consumed the same rows, in the same order, up to
it. Pure NumPy on values the loader already holds: no device, no collective.
"""

from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on ``uint64`` (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_hashes(start: int, sources: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """The 64-bit hash of each of rows ``start, start + 1, ...`` from its source and window."""
    index = np.arange(start, start + len(sources), dtype=np.uint64)
    h = _mix(_mix(index) ^ sources.astype(np.uint64))
    return _mix(h ^ windows.astype(np.uint64))


def add_rows(digest: int, hashes: np.ndarray) -> int:
    """``digest`` with the rows of ``hashes`` added."""
    return (digest + int(hashes.sum(dtype=np.uint64))) & MASK


def digest_hex(digest: int) -> str:
    """The digest as it is logged and saved: 16 hex digits."""
    return f"{digest:016x}"


def parse_digest(text: str) -> int:
    """``digest_hex``'s inverse; ``ValueError`` for anything else."""
    if len(text) != 16:
        raise ValueError(f"{text!r} is not 16 hex digits")
    return int(text, 16)
