"""Which window sits at which position: a pure function of (seed, epoch, index)."""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of ``n`` windows in ``epoch``; the same (seed, epoch, n) always gives the same."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    perm.flags.writeable = False
    return perm


def sample_at(seed: int, epoch: int, index: int, n: int) -> int:
    """Window index at position ``index`` of ``epoch``."""
    return int(epoch_permutation(seed, epoch, n)[index])
