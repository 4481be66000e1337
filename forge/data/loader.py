"""The training loader: mixtures, phases, packing, worker processes, exact O(1) resume.

A run reads one stream of rows numbered over every rank and micro-batch; how a step is split
(``train.batch_size`` × data-parallel ranks × ``train.grad_accum_steps``) only says which rows
each rank reads when. A *plan* (the windows one rank reads for one micro-batch) is a pure
function of the layout-free loader state ``(steps, cursors)``; see
``forge.data.mixture``. Plans are made in the training process and read (memmap, stack, pack)
in worker processes when ``num_workers > 0``. Each batch carries the loader state after it, so
prefetching workers never make the saved state run ahead of what training consumed, and a
resume, on any layout of the same global batch, is a seek, never a replay.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from forge.data.batch import Batch
from forge.data.context_split import context_shard
from forge.data.dataset import TokenWindows
from forge.data.image_text import ImageCaptions
from forge.data.mixture import (
    Phase,
    active_phase,
    row_cursors,
    row_sources,
)
from forge.data.packing import pack
from forge.data.row_digest import add_rows, digest_hex, parse_digest
from forge.data.row_order import rows_before, window_indices
from forge.data.shards import DataError


@attrs.frozen
class LoaderState:
    """Where the next micro-batch comes from, the same on every rank and for every layout:
    the global rows consumed, the data steps completed (phases follow them), the rows of the
    unfinished step already read, each source's cursor, and the digest of every row consumed
    (``forge.data.row_digest``)."""

    steps: int = 0
    cursors: tuple[int, ...] = (0,)
    digest: int = 0
    step_rows: int = 0

    @property
    def rows(self) -> int:
        """Global rows consumed: every row is drawn from one source, so the cursors' sum."""
        return sum(self.cursors)


@attrs.frozen
class Plan:
    """What one rank reads for one micro-batch, and the loader state after it."""

    rows: tuple[tuple[int, int], ...]  # (source, window index)
    lr_scale: float
    after: LoaderState


@attrs.frozen
class Sampling:
    """The fixed parameters of the plan sequence, shared by every rank."""

    sizes: tuple[int, ...]  # windows per source
    phases: tuple[Phase, ...]
    seed: int
    batch_size: int
    rank: int = 0
    world_size: int = 1
    grad_accum_steps: int = 1
    max_epochs: int | None = None

    @property
    def micro_rows(self) -> int:
        """Rows of one micro-batch over every data-parallel rank."""
        return self.batch_size * self.world_size

    @property
    def step_rows(self) -> int:
        """Rows of one optimizer step: the global batch."""
        return self.micro_rows * self.grad_accum_steps


def single_source(size: int, batch_size: int, seed: int, **kwargs: Any) -> Sampling:
    """Sampling of one source of ``size`` windows (no mixture, no phases); ``kwargs`` as
    ``Sampling``'s."""
    return Sampling((size,), (Phase(1, (1.0,), 1.0),), seed, batch_size, **kwargs)


def plan_at(state: LoaderState, s: Sampling) -> Plan | None:
    """The plan of the micro-batch that starts at global row ``state.rows``; None once
    ``max_epochs`` is used up (checked for a whole step at its start, ``exhausts``). Its rows
    belong to data step ``state.steps + 1``, whose phase they follow."""
    phase = active_phase(s.phases, state.steps + 1)
    if s.max_epochs is not None and state.step_rows == 0 and exhausts(state, s, phase):
        return None
    count = s.micro_rows
    sources = row_sources(s.seed, state.rows, count, phase.probabilities)
    positions, after = row_cursors(sources, state.cursors)
    windows = window_indices(s.seed, s.sizes, sources, positions)
    mine = slice(s.rank * s.batch_size, (s.rank + 1) * s.batch_size)
    rows = tuple(zip(sources[mine].tolist(), windows[mine].tolist(), strict=True))
    into_step = state.step_rows + count
    ends_step = into_step >= s.step_rows
    following = LoaderState(
        steps=state.steps + int(ends_step),
        cursors=after,
        digest=add_rows(state.digest, state.rows, sources, windows),
        step_rows=0 if ends_step else into_step,
    )
    return Plan(rows, phase.lr_scale, following)


def exhausts(state: LoaderState, s: Sampling, phase: Phase) -> bool:
    """Whether the step that starts at ``state`` would reach a source's epoch
    ``max_epochs``: the data runs out at a step's start, never inside one, so no checkpoint
    holds part of a step and every split stops after the same step."""
    sources = row_sources(s.seed, state.rows, s.step_rows, phase.probabilities)
    positions, _ = row_cursors(sources, state.cursors)
    epochs = positions // np.asarray(s.sizes, dtype=np.int64)[sources]
    return s.max_epochs is not None and int(epochs.max()) >= s.max_epochs


def plans_from(state: LoaderState, sampling: Sampling) -> Iterator[Plan]:
    """Plans from ``state`` on, until the data is used up."""
    while (plan := plan_at(state, sampling)) is not None:
        yield plan
        state = plan.after


def read_rows(sources: Sequence[TokenWindows], rows: Sequence[tuple[int, int]]) -> np.ndarray:
    """The windows ``rows`` name, ``(source, window)`` each, in their order: each source's
    read in one ``TokenWindows.stack``."""
    if len(sources) == 1:
        return sources[0].stack([window for _, window in rows])
    by_source: dict[int, list[int]] = {}
    for i, (source, _) in enumerate(rows):
        by_source.setdefault(source, []).append(i)
    out: np.ndarray | None = None
    for source, at in by_source.items():
        block = sources[source].stack([rows[i][1] for i in at])
        if out is None:
            out = np.empty((len(rows), block.shape[1]), dtype=block.dtype)
        out[at] = block
    assert out is not None, "a plan reads at least one row"
    return out


class WindowReader(Dataset):
    """Reads a plan's windows into a CPU ``Batch`` (in a worker process, if any)."""

    def __init__(self, sources: Sequence[TokenWindows], bos_id: int | None) -> None:
        self.sources = list(sources)
        self.bos_id = bos_id  # None: no packing

    def __getitem__(self, plan: Plan) -> tuple[Batch, LoaderState]:  # type: ignore[override]
        rows = read_rows(self.sources, plan.rows)
        tokens = torch.from_numpy(rows.astype(np.int64))
        sources = torch.from_numpy(np.array([src for src, _ in plan.rows], dtype=np.int64))
        if self.bos_id is None:
            batch = Batch(tokens[:, :-1], tokens[:, 1:], sources=sources, lr_scale=plan.lr_scale)
        else:
            p = pack(tokens, self.bos_id)
            batch = Batch(p.inputs, p.labels, p.positions, p.document_ids, sources, plan.lr_scale)
        return batch, plan.after


def caption_batch(captions: ImageCaptions, indices: Sequence[int], lr_scale: float = 1.0) -> Batch:
    """Examples ``indices`` of ``captions`` as a CPU ``Batch``: caption rows and images."""
    inputs, labels = captions.rows(indices)
    images = np.stack([captions.images[i] for i in indices])
    return Batch(
        torch.from_numpy(inputs),
        torch.from_numpy(labels),
        sources=torch.zeros(len(indices), dtype=torch.int64),
        lr_scale=lr_scale,
        images=torch.from_numpy(images),
    )


class ImageCaptionReader(Dataset):
    """Reads a plan's examples (image and caption) into a CPU ``Batch`` with images."""

    def __init__(self, captions: ImageCaptions) -> None:
        self.captions = captions

    def __getitem__(self, plan: Plan) -> tuple[Batch, LoaderState]:  # type: ignore[override]
        indices = [index for _, index in plan.rows]
        return caption_batch(self.captions, indices, plan.lr_scale), plan.after


def _as_is(item: Any) -> Any:
    return item


class TextLoader:
    """Yields micro-batches; each data-parallel rank reads its own rows of every micro-batch.

    ``sources``: token windows, one per source, or one split of image–caption examples
    (batches then carry the images). Its whole state is a ``LoaderState``:
    ``load_state_dict`` seeks there in O(1). With ``max_epochs`` set, iteration stops before
    any source starts epoch ``max_epochs``. Batches are placed on ``device`` (the training
    device). ``context`` ``(rank, cp)``: under context parallelism each batch is cut to this
    rank's tokens of every row (``forge.data.context_split``).
    """

    def __init__(
        self,
        sources: Sequence[TokenWindows] | ImageCaptions,
        sampling: Sampling,
        *,
        bos_id: int | None = None,
        num_workers: int = 0,
        device: torch.device | str = "cpu",
        context: tuple[int, int] = (0, 1),
    ) -> None:
        self.reader: WindowReader | ImageCaptionReader
        if isinstance(sources, ImageCaptions):
            self.reader, count = ImageCaptionReader(sources), 1
        else:
            self.reader, count = WindowReader(sources, bos_id), len(sources)
        if count != len(sampling.sizes):
            raise ValueError("one TokenWindows per source (image–caption data is one source)")
        self.sampling = sampling
        self.num_workers = num_workers
        self.device = torch.device(device)
        self.context = context
        self.state = LoaderState(cursors=(0,) * len(sampling.sizes))
        self._stream: Iterator[tuple[Batch, LoaderState]] | None = None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def _open(self) -> Iterator[tuple[Batch, LoaderState]]:
        plans: Iterable[Plan] = plans_from(self.state, self.sampling)
        if self.num_workers == 0:
            return map(self.reader.__getitem__, plans)
        return iter(
            DataLoader(
                self.reader,
                sampler=plans,  # type: ignore[arg-type]
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=_as_is,
                pin_memory=pins_host_memory(self.device),  # pinned in DataLoader's own thread
            )
        )

    def __next__(self) -> Batch:
        if self._stream is None:
            self._stream = self._open()
        batch, self.state = next(self._stream)
        return self._placed(batch, pinned=self.num_workers > 0)

    def _placed(self, batch: Batch, pinned: bool) -> Batch:
        """``batch`` on the training device, cut to this rank's tokens under context
        parallelism."""
        if not pinned and pins_host_memory(self.device):
            batch = batch.pin_memory()
        batch = batch.to(self.device)
        if self.context[1] > 1:
            batch = context_shard(batch, self.context[1], self.context[0])
        return batch

    def step_share(self, share: range) -> tuple[tuple[Batch, ...], LoaderState] | None:
        """The micro-batches ``share`` of the step that starts at this loader's position (a
        replica group's, ``share_of``), read in this process, and the position after the
        whole step, which ``seek`` applies once the step commits; None when the data is used
        up. The position itself does not move: a step that does not commit is read again."""
        if self.state.step_rows:
            raise ValueError("a replica group's share starts at a step's first micro-batch")
        self._stream = None
        state, batches = self.state, []
        for slot in range(self.sampling.grad_accum_steps):
            plan = plan_at(state, self.sampling)
            if plan is None:
                return None
            if slot in share:
                batch, _ = self.reader[plan]
                batches.append(self._placed(batch, pinned=False))
            state = plan.after
        return tuple(batches), state

    def seek(self, state: LoaderState) -> None:
        """Continue from ``state`` (a committed step's ``step_share`` position)."""
        self.state = state
        self._stream = None

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position of the next micro-batch, free of the layout."""
        st = self.state
        return {
            "rows": st.rows,
            "steps": st.steps,
            "step_rows": st.step_rows,
            "cursors": list(st.cursors),
            "digest": digest_hex(st.digest),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to a position saved by ``state_dict``, whatever layout saved it (worker
        processes restart from there)."""
        self.state = loader_state(state, self.sampling)
        self._stream = None

    def close(self) -> None:
        """Stop the worker processes now (else they stop whenever the iterator is garbage
        collected, possibly in the middle of a later run in the same process)."""
        stream, self._stream = self._stream, None
        shutdown = getattr(stream, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def rewind(self) -> None:
        """Back to the first micro-batch (the held-out loader, before each evaluation)."""
        self.state = LoaderState(cursors=(0,) * len(self.sampling.sizes))
        self._stream = None


LOADER_KEYS = ("rows", "steps", "step_rows", "cursors", "digest")


def loader_state(saved: dict[str, Any], sampling: Sampling) -> LoaderState:
    """The ``LoaderState`` a saved position names, checked against ``sampling``: a
    ``DataError`` naming what does not fit (another forge's record, another number of
    sources, a position inside a step that this layout cannot split)."""
    if "micro_batch" in saved:
        raise DataError(
            "the checkpoint's loader position is counted in micro-batches (an earlier forge, "
            "whose sample order depended on how a step was split); this forge cannot continue "
            "that order exactly: start the run afresh"
        )
    if set(saved) != set(LOADER_KEYS):
        raise DataError(f"loader state {saved} is not one this forge writes; start afresh")
    try:
        cursors = tuple(int(c) for c in saved["cursors"])
        rows = int(saved["rows"])  # saved for readers; the cursors' sum, checked below
        state = LoaderState(
            int(saved["steps"]),
            cursors,
            parse_digest(str(saved["digest"])),
            int(saved["step_rows"]),
        )
    except (TypeError, ValueError) as exc:
        raise DataError(f"loader state {saved} is not one this forge writes ({exc})") from None
    if len(cursors) != len(sampling.sizes):
        raise DataError(
            f"the checkpoint's loader has {len(cursors)} data sources, the config "
            f"{len(sampling.sizes)}; resume with the [data] sources it was saved with"
        )
    if min(state.steps, state.step_rows, *cursors) < 0 or state.rows != rows:
        raise DataError(f"loader state {saved} does not add up (rows ≠ the sum of its cursors)")
    expected = rows_before(sampling.seed, sampling.sizes, sampling.phases, state.rows)
    if expected is not None and expected != (state.cursors, state.digest):
        raise DataError(
            f"loader state {saved} is not the position its rows lead to (digest "
            f"{digest_hex(expected[1])}, cursors {list(expected[0])} for {rows} rows): the "
            "record was edited or damaged"
        )
    if state.step_rows % sampling.micro_rows or state.step_rows >= sampling.step_rows:
        raise DataError(
            f"the checkpoint stopped {state.step_rows} rows into a step, which micro-batches "
            f"of {sampling.micro_rows} rows (train.batch_size × data-parallel ranks) cannot "
            "continue; resume with the layout it was saved with"
        )
    return state


def pins_host_memory(device: torch.device) -> bool:
    """Whether batches bound for ``device`` go through page-locked memory: for a GPU, so that
    the host-to-device copy does not block the step (a CPU run copies nothing)."""
    return device.type == "cuda"


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
