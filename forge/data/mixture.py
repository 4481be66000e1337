"""Which source each row of a micro-batch comes from: pure functions of (seed, micro-batch).

A mixture's state is one cursor per source (rows drawn from it so far, over all ranks); row
``k`` of source ``s`` is window ``perm_s(epoch)[k % n_s]`` with ``epoch = k // n_s``. Drawing a
micro-batch's sources depends only on ``(seed, micro_batch)`` and the active phase's
probabilities, so a saved ``(micro_batch, cursors)`` resumes exactly, at O(1) cost.
"""

from __future__ import annotations

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


def step_of_micro_batch(micro_batch: int, grad_accum_steps: int) -> int:
    """The (1-based) optimizer step that consumes micro-batch ``micro_batch`` (0-based)."""
    return micro_batch // grad_accum_steps + 1


def draw_sources(
    seed: int, micro_batch: int, probabilities: Sequence[float], rows: int
) -> np.ndarray:
    """Source index of each of the ``rows`` rows (all ranks) of micro-batch ``micro_batch``."""
    if len(probabilities) == 1:
        return np.zeros(rows, dtype=np.int64)
    rng = np.random.default_rng([seed, micro_batch, 0x6D6978])  # "mix": apart from shuffles
    return rng.choice(len(probabilities), size=rows, p=np.asarray(probabilities))


def row_cursors(sources: np.ndarray, cursors: Sequence[int]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Each row's position in its source's stream, and the cursors after the micro-batch."""
    positions = np.empty(len(sources), dtype=np.int64)
    after = list(cursors)
    for row, source in enumerate(sources.tolist()):
        positions[row] = after[source]
        after[source] += 1
    return positions, tuple(after)
