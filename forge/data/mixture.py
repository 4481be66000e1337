"""Which source each row comes from: pure functions of (seed, global row index).

A run reads one stream of rows, numbered over every rank and micro-batch (the *global row
index*); however a step is split (batch size, accumulation, data-parallel ranks), step ``k``
reads the same rows. Row ``g`` draws its source from a uniform number that depends only on
``(seed, g)``, under the probabilities of the phase of the step it belongs to. A mixture's
state is one cursor per source (rows drawn from it so far); the ``k``-th row of source ``s``
is window ``perm_s(epoch)[k % n_s]`` with ``epoch = k // n_s``. So a saved
``(rows, steps, cursors)`` resumes exactly, on any layout, at O(1) cost.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np

from forge.config.sections import DataPhase, DataSource


@attrs.frozen
class Phase:
    """Resolved phase: from step ``start_step`` on, these source probabilities and LR scale."""

    start_step: int
    probabilities: tuple[float, ...]
    lr_scale: float


def mixture_probabilities(weights: Sequence[float], temperature: float) -> tuple[float, ...]:
    """Sampling probabilities ``∝ weight ** (1 / temperature)``; zero weights stay zero."""
    w = np.asarray(weights, dtype=np.float64)
    scaled = np.where(w > 0, w ** (1.0 / temperature), 0.0)
    return tuple(float(x) for x in scaled / scaled.sum())


def resolve_phases(
    sources: Sequence[DataSource], phases: Sequence[DataPhase], temperature: float
) -> tuple[Phase, ...]:
    """The base mix (from step 1, LR scale 1) followed by each configured phase."""
    base = [s.weight for s in sources]
    resolved = [Phase(1, mixture_probabilities(base, temperature), 1.0)]
    for phase in phases:
        weights = [phase.weights.get(s.name, s.weight) for s in sources]
        probs = mixture_probabilities(weights, temperature)
        resolved.append(Phase(phase.start_step, probs, phase.lr_scale))
    return tuple(resolved)


def active_phase(phases: Sequence[Phase], step: int) -> Phase:
    """The last phase whose ``start_step <= step`` (``step`` is 1-based, as logged)."""
    current = phases[0]
    for phase in phases:
        if phase.start_step <= step:
            current = phase
    return current


UNIFORM_BLOCK = 4096  # rows whose uniforms are drawn together (cached): a layout-free unit


@functools.lru_cache(maxsize=8)
def block_uniforms(seed: int, block: int) -> np.ndarray:
    """The uniform numbers of rows ``block * UNIFORM_BLOCK`` onwards (read-only)."""
    u = np.random.default_rng([seed, block, 0x6D6978]).random(UNIFORM_BLOCK)  # "mix"
    u.flags.writeable = False
    return u


def row_uniforms(seed: int, start: int, count: int) -> np.ndarray:
    """The uniform numbers in [0, 1) of global rows ``start .. start + count - 1``."""
    first, last = start // UNIFORM_BLOCK, (start + count - 1) // UNIFORM_BLOCK
    joined = np.concatenate([block_uniforms(seed, b) for b in range(first, last + 1)])
    offset = start - first * UNIFORM_BLOCK
    return joined[offset : offset + count]


def row_sources(seed: int, start: int, count: int, probabilities: Sequence[float]) -> np.ndarray:
    """The source of each of global rows ``start .. start + count - 1``: row ``g`` takes the
    first source whose cumulative probability exceeds its uniform, so a source of weight
    zero is never drawn."""
    if len(probabilities) == 1:
        return np.zeros(count, dtype=np.int64)
    cumulative = np.cumsum(np.asarray(probabilities, dtype=np.float64))
    cumulative /= cumulative[-1]  # the last edge is exactly 1, above every uniform
    return np.searchsorted(cumulative, row_uniforms(seed, start, count), side="right")


def row_cursors(sources: np.ndarray, cursors: Sequence[int]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Each row's position in its source's stream, and the cursors after these rows."""
    if len(cursors) == 1:  # one source: the next rows of its stream
        return np.arange(cursors[0], cursors[0] + len(sources)), (cursors[0] + len(sources),)
    positions = np.empty(len(sources), dtype=np.int64)
    after = list(cursors)
    for source in range(len(after)):
        mine = sources == source
        count = int(np.count_nonzero(mine))
        positions[mine] = after[source] + np.arange(count)
        after[source] += count
    return positions, tuple(after)
