"""Sample accounting: a digest of the rows a run has consumed, to compare two runs row for row.

Each row is named by ``(global row index, source, window)`` (a window is a fixed token offset
in one shard of its source's dataset, given ``train.seq_len``) and hashed to 64 bits; a run's
digest is the sum of its rows' hashes modulo 2**64. A sum does not depend on how the rows were
grouped into micro-batches or ranks, and the row index in each hash makes it depend on their
order: two runs with equal digests at a step consumed the same rows, in the same order, up to
it. Computed from values the loader already holds (NumPy arrays, or Python integers for a
few rows): no device, no collective.
"""

from __future__ import annotations

import re

import numpy as np

MASK = (1 << 64) - 1


# SplitMix64's constants (immutable NumPy scalars, made once: each costs a call per use)
GOLDEN, MUL1, MUL2 = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)
SOURCE_MUL = np.uint64(0xC2B2AE3D27D4EB4F)
S27, S30, S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on ``uint64`` (wrapping arithmetic)."""
    x = x + GOLDEN
    x = (x ^ (x >> S30)) * MUL1
    x = (x ^ (x >> S27)) * MUL2
    return x ^ (x >> S31)


def row_hashes(start: int, sources: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """The 64-bit hash of each of rows ``start, start + 1, ...`` from its source and window:
    the three spread over 64 bits by odd multipliers, then mixed once."""
    index = np.arange(start, start + len(sources), dtype=np.uint64)
    key = (index * GOLDEN) ^ (sources.astype(np.uint64) * SOURCE_MUL)
    return _mix(key ^ windows.astype(np.uint64))


# the same constants as Python integers, for the few-rows path
_GOLDEN, _SOURCE, _MUL1, _MUL2 = int(GOLDEN), int(SOURCE_MUL), int(MUL1), int(MUL2)


def row_hash(index: int, source: int, window: int) -> int:
    """``row_hashes`` of one row, in Python integers (cheaper than NumPy for a few rows)."""
    x = (((index * _GOLDEN) ^ (source * _SOURCE) ^ window) + _GOLDEN) & MASK
    x = ((x ^ (x >> 30)) * _MUL1) & MASK
    x = ((x ^ (x >> 27)) * _MUL2) & MASK
    return x ^ (x >> 31)


FEW_ROWS = 32  # up to this many rows, Python integers hash faster than NumPy arrays


def add_rows(digest: int, start: int, sources: np.ndarray, windows: np.ndarray) -> int:
    """``digest`` with rows ``start, start + 1, ...`` (their sources and windows) added."""
    if len(sources) <= FEW_ROWS:
        total = 0
        for i, (source, window) in enumerate(zip(sources.tolist(), windows.tolist(), strict=True)):
            total += row_hash(start + i, source, window)
    else:
        total = int(row_hashes(start, sources, windows).sum(dtype=np.uint64))
    return (digest + total) & MASK


def digest_hex(digest: int) -> str:
    """The digest as it is logged and saved: 16 hex digits."""
    return f"{digest:016x}"


def parse_digest(text: str) -> int:
    """``digest_hex``'s inverse; ``ValueError`` for anything else."""
    if re.fullmatch(r"[0-9a-f]{16}", text) is None:
        raise ValueError(f"{text!r} is not 16 hex digits")
    return int(text, 16)
