"""Which window sits at which position: a pure function of (seed, epoch, index)."""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=16)
def epoch_permutation(seed: int, epoch: int, n: int, stream: int = 0) -> np.ndarray:
    """The order of ``n`` windows in ``epoch``; the same arguments always give the same.

    ``stream`` separates the orders of several sources that share one seed.
    """
    key = [seed, epoch] if stream == 0 else [seed, epoch, stream]
    perm = np.random.default_rng(key).permutation(n)
    perm.flags.writeable = False
    return perm


def sample_at(seed: int, epoch: int, index: int, n: int) -> int:
    """Window index at position ``index`` of ``epoch``."""
    return int(epoch_permutation(seed, epoch, n)[index])
