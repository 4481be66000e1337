"""The training loader: plans, mixtures, phases, workers and exact resume by seeking."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forge.config import DataPhase, DataSource
from forge.data.dataset import TokenWindows
from forge.data.loader import Sampling, TextLoader, single_source, step_batches
from forge.data.mixture import resolve_phases

SEQ = 8


def windows(n: int, offset: int = 0) -> TokenWindows:
    """``n`` windows whose tokens are ``offset + position`` (so a row names its source)."""
    return TokenWindows([np.arange(n * SEQ + 1) + offset], seq_len=SEQ)


def one_source(n_windows=40, batch=4, **kw) -> TextLoader:
    return TextLoader([windows(n_windows)], single_source(n_windows, batch, seed=5, **kw))


def mixture(
    phases=(), workers=0, rank=0, world_size=1, grad_accum=1, sizes=(30, 50), batch=4, seed=11
):
    sources = [DataSource("a", "-", 3.0), DataSource("b", "-", 1.0)]
    sampling = Sampling(
        sizes=sizes,
        phases=resolve_phases(sources, phases, temperature=1.0),
        seed=seed,
        batch_size=batch,
        rank=rank,
        world_size=world_size,
        grad_accum_steps=grad_accum,
    )
    # source a's tokens are < 1000, source b's >= 1000
    return TextLoader([windows(sizes[0]), windows(sizes[1], 1000)], sampling, num_workers=workers)


def test_labels_are_inputs_shifted_by_one():
    b = next(one_source())
    assert torch.equal(b.inputs[:, 1:], b.labels[:, :-1])
    assert b.inputs.dtype == torch.int64 and b.num_tokens == 32
    assert b.sources is not None and b.sources.tolist() == [0, 0, 0, 0]


def test_an_epoch_visits_every_window_once():
    loader = one_source(n_windows=40, batch=4)
    starts = [int(r[0]) for _ in range(10) for r in next(loader).inputs]
    assert sorted(starts) == sorted(int(windows(40)[i][0]) for i in range(40))


def test_max_epochs_ends_iteration():
    loader = one_source(max_epochs=2)
    assert len(list(loader)) == 2 * 10
    position = loader.state_dict()
    assert (position["rows"], position["steps"], position["cursors"]) == (80, 20, [80])


@pytest.mark.parametrize(("batch", "accum"), [(4, 2), (2, 4), (1, 8), (8, 1)])
def test_max_epochs_ends_at_a_step_boundary_whatever_the_split(batch, accum):
    """12 windows, one epoch, steps of 8 rows: one whole step, then nothing, and the position
    saved after it is the same for every split (no rows of an untrained step in it)."""
    loader = one_source(n_windows=12, batch=batch, grad_accum_steps=accum, max_epochs=1)
    assert len(list(step_batches(loader, accum))) == 1
    position = loader.state_dict()
    assert (position["rows"], position["steps"], position["step_rows"]) == (8, 1, 0)


def test_ranks_take_disjoint_rows_of_each_micro_batch():
    a, b = one_source(rank=0, world_size=2), one_source(rank=1, world_size=2)
    rows_a = {tuple(r.tolist()) for _ in range(5) for r in next(a).inputs}
    rows_b = {tuple(r.tolist()) for _ in range(5) for r in next(b).inputs}
    assert len(rows_a) == len(rows_b) == 20 and not rows_a & rows_b
    assert a.state_dict() == b.state_dict()  # the same position on every rank


def test_step_batches_group_micro_batches_and_drop_a_partial_group():
    groups = list(step_batches(one_source(max_epochs=1), 3))
    assert len(groups) == 3 and all(len(g) == 3 for g in groups)  # 10 batches -> 3 groups


def source_share(loader, micro_batches):
    rows = torch.cat([next(loader).sources for _ in range(micro_batches)])
    return float((rows == 0).float().mean())


@pytest.mark.parametrize(
    ("temperature", "expected_a"),
    [(1.0, 0.75), (2.0, 3**0.5 / (3**0.5 + 1)), (1e6, 0.5)],  # ∝ weight ** (1 / T)
)
def test_observed_source_fractions_match_the_tempered_weights(temperature, expected_a):
    sources = [DataSource("a", "-", 3.0), DataSource("b", "-", 1.0)]
    sampling = Sampling((30, 50), resolve_phases(sources, (), temperature), 11, batch_size=8)
    loader = TextLoader([windows(30), windows(50, 1000)], sampling)
    # 500 micro-batches x 8 rows: the binomial standard error is < 0.008; allow 4 of them
    assert abs(source_share(loader, 500) - expected_a) < 0.03


def test_rows_say_their_source():
    loader = mixture()
    for _ in range(20):
        b = next(loader)
        from_b = b.inputs[:, 0] >= 1000
        assert torch.equal(from_b, b.sources == 1)


def test_a_phase_switches_weights_and_lr_scale_at_its_step():
    """Phase from step 6 (grad_accum 2: micro-batches 10 on): only source b, LR x0.1."""
    loader = mixture(phases=[DataPhase(start_step=6, weights={"a": 0.0}, lr_scale=0.1)],
                     grad_accum=2)  # fmt: skip
    steps = list(zip(range(1, 41), step_batches(loader, 2), strict=False))
    for step, group in steps:
        lr_scales = {b.lr_scale for b in group}
        sources = torch.cat([b.sources for b in group])
        if step < 6:
            assert lr_scales == {1.0}, step
        else:
            assert lr_scales == {0.1} and bool((sources == 1).all()), step
    early = torch.cat([b.sources for step, g in steps if step < 6 for b in g])
    assert bool((early == 0).any())  # before the switch, source a still appears


RESUME_CASES = {
    # name: (loader factory, micro-batches consumed before the save)
    "single source": (lambda: one_source(n_windows=40), 7),
    "across an epoch boundary": (lambda: one_source(n_windows=40), 9),  # 10 per epoch
    "mixture": (lambda: mixture(), 13),
    "mixture across a phase switch": (
        lambda: mixture(phases=[DataPhase(start_step=16, weights={"b": 5.0}, lr_scale=0.5)]),
        13,
    ),
    "mixture, source epochs wrap": (lambda: mixture(sizes=(6, 9)), 11),
    "2 workers": (lambda: mixture(workers=2), 13),
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_batches_after_a_resume_equal_the_uninterrupted_ones(case):
    make, consumed = RESUME_CASES[case]
    reference = make()
    expected = [next(reference) for _ in range(consumed + 8)][consumed:]
    interrupted = make()
    for _ in range(consumed):
        next(interrupted)
    saved = json.loads(json.dumps(interrupted.state_dict()))  # as the checkpoint stores it
    resumed = make()
    resumed.load_state_dict(saved)
    for want in expected:
        got = next(resumed)
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.labels, want.labels)
        assert torch.equal(got.sources, want.sources) and got.lr_scale == want.lr_scale


def test_worker_prefetch_does_not_advance_the_saved_state():
    loader = mixture(workers=2)
    for _ in range(3):
        next(loader)
    assert loader.state_dict()["rows"] == 3 * 4


def test_workers_read_the_same_batches_as_the_training_process():
    inline, workers = mixture(), mixture(workers=2)
    for _ in range(12):
        assert torch.equal(next(inline).inputs, next(workers).inputs)


def position(**changes):
    """A saved position of ``mixture()`` after 3 micro-batches, with ``changes``."""
    loader = mixture()
    for _ in range(3):
        next(loader)
    return loader.state_dict() | changes


def moved(extra: int, swap: bool = False) -> dict:
    """``position()`` with its rows and first cursor moved on by ``extra`` (or its cursors
    traded), its digest left as it was: the record adds up, the rows it names were not
    read."""
    saved = position()
    cursors = list(saved["cursors"])
    cursors = cursors[::-1] if swap else [cursors[0] + extra, *cursors[1:]]
    return saved | {"cursors": cursors, "rows": saved["rows"] + extra}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0, "batch": 3}, "not one this forge writes"),
        ({"micro_batch": 3, "cursors": [1, 2]}, "counted in micro-batches"),
        (position(cursors=[1, 2, 9]), "has 3 data sources, the config 2"),
        (position(rows=13), "does not add up"),
        (position(digest="xyz"), "not one this forge writes"),
        (position(digest="-00000000000001f"), "not one this forge writes"),
        (position(digest="0x0000000000001f"), "not one this forge writes"),
        (position(cursors=["a", 2]), "not one this forge writes"),
        (position(step_rows=2), "cannot continue"),
        (moved(4), "not the position its rows lead to"),
        (moved(0, swap=True), "not the position its rows lead to"),
        (position(digest="00000000000000ff"), "not the position its rows lead to"),
    ],
    ids=[
        "foreign keys",
        "an earlier forge's micro-batch count",
        "another number of sources",
        "rows that are not the sum of the cursors",
        "a digest that is not 16 hex digits",
        "a negative digest",
        "a digest with a 0x prefix",
        "a cursor that is no number",
        "a position inside a step that this layout cannot split",
        "rows and cursors moved on, the digest kept (a hand-edited train state)",
        "the cursors traded between sources",
        "another digest",
    ],
)
def test_a_foreign_loader_state_is_refused(state, message):
    from forge.data.shards import DataError

    with pytest.raises(DataError, match=message):
        mixture().load_state_dict(state)


# layouts of one global batch of 8 rows: (batch_size, data-parallel ranks, grad_accum_steps)
LAYOUTS = {
    "b8 x acc1": (8, 1, 1),
    "b2 x acc4": (2, 1, 4),
    "b1 x acc8": (1, 1, 8),
    "2 ranks x b1 x acc4": (1, 2, 4),
    "4 ranks x b2 x acc1": (2, 4, 1),
}
PHASE = [DataPhase(start_step=4, weights={"a": 0.0}, lr_scale=0.5)]


def layout_loaders(layout, **kw):
    batch, ranks, accum = LAYOUTS[layout]
    return [
        mixture(batch=batch, rank=r, world_size=ranks, grad_accum=accum, phases=PHASE, **kw)
        for r in range(ranks)
    ]


def steps_read(loaders, steps, accum):
    """Per step: the rows every rank read (their first tokens, in global row order: micro-batch
    by micro-batch, rank by rank), the LR scales, and the digest after it."""
    out, groups = [], [step_batches(loader, accum) for loader in loaders]
    for _ in range(steps):
        per_rank = [next(g) for g in groups]
        rows = [int(t) for m in range(accum) for rank in per_rank for t in rank[m].inputs[:, 0]]
        scales = {b.lr_scale for rank in per_rank for b in rank}
        out.append((rows, scales, loaders[0].state_dict()["digest"]))
    return out


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "b8 x acc1"])
def test_every_split_of_a_step_reads_the_same_rows_in_the_same_order(layout):
    """A phase at step 4 (source a off, LR x0.5) fires at step 4 whatever the split."""
    reference = steps_read(layout_loaders("b8 x acc1"), 8, 1)
    assert steps_read(layout_loaders(layout), 8, LAYOUTS[layout][2]) == reference
    assert [s for _, s, _ in reference] == [{1.0}] * 3 + [{0.5}] * 5
    assert all(t >= 1000 for rows, _, _ in reference[3:] for t in rows)  # only source b


@pytest.mark.parametrize(("saved", "resumed"), [("b8 x acc1", "2 ranks x b1 x acc4"),
                                                ("2 ranks x b1 x acc4", "b2 x acc4"),
                                                ("4 ranks x b2 x acc1", "b1 x acc8")])  # fmt: skip
def test_a_resume_on_another_layout_continues_the_same_rows(saved, resumed):
    """3 steps on one layout, saved as the checkpoint stores it, 5 more on another: the rows
    and digests of the uninterrupted run (the phase switch falls inside the resumed span)."""
    reference = steps_read(layout_loaders("b8 x acc1"), 8, 1)
    first = layout_loaders(saved)
    head = steps_read(first, 3, LAYOUTS[saved][2])
    state = json.loads(json.dumps(first[0].state_dict()))
    assert all(loader.state_dict() == state for loader in first)  # the same on every rank
    second = layout_loaders(resumed)
    for loader in second:
        loader.load_state_dict(state)
    assert head + steps_read(second, 5, LAYOUTS[resumed][2]) == reference


def test_the_digest_names_the_rows_and_their_order():
    """Equal for the same rows in the same order; another seed, or the same rows in another
    order, gives another digest."""
    from forge.data.row_digest import add_rows

    a = steps_read(layout_loaders("b8 x acc1"), 2, 1)
    assert a == steps_read(layout_loaders("b8 x acc1"), 2, 1)
    assert a[1][2] != steps_read(layout_loaders("b8 x acc1", seed=12), 2, 1)[1][2]
    sources, windows = np.array([0, 1, 1]), np.array([5, 7, 9])
    ordered = add_rows(0, 0, sources, windows)
    assert ordered != add_rows(0, 0, sources[[1, 0, 2]], windows[[1, 0, 2]])
    assert (
        add_rows(add_rows(0, 0, sources[:1], windows[:1]), 1, sources[1:], windows[1:]) == ordered
    )


@pytest.mark.parametrize("rows", [1, 31, 32, 33, 500])
def test_few_rows_hash_in_python_integers_as_many_do_in_numpy(rows):
    """Two paths of one hash (``FEW_ROWS``): equal on either side of the switch."""
    from forge.data.row_digest import MASK, add_rows, row_hash, row_hashes

    rng = np.random.default_rng(rows)
    sources, windows = rng.integers(0, 3, rows), rng.integers(0, 2**40, rows)
    start = 10**12 + rows
    by_numpy = int(row_hashes(start, sources, windows).sum(dtype=np.uint64))
    by_python = sum(
        row_hash(start + i, int(s), int(w))
        for i, (s, w) in enumerate(zip(sources, windows, strict=True))
    )
    assert by_numpy == by_python & MASK == add_rows(0, start, sources, windows)


def test_a_source_of_weight_zero_is_never_drawn_and_one_of_weight_one_always():
    from forge.data.mixture import row_sources

    assert set(row_sources(3, 0, 5000, (0.0, 1.0, 0.0)).tolist()) == {1}
    assert set(row_sources(3, 4090, 20, (0.5, 0.5, 0.0)).tolist()) <= {0, 1}
    assert set(row_sources(3, 0, 5000, (1.0, 0.0)).tolist()) == {0}


def test_row_sources_are_a_function_of_the_global_row_alone():
    """Rows drawn in one call or piece by piece, across a block of cached uniforms, agree."""
    from forge.data.mixture import UNIFORM_BLOCK, row_sources

    p = (0.2, 0.3, 0.5)
    whole = row_sources(9, UNIFORM_BLOCK - 7, 20, p)
    pieces = np.concatenate([row_sources(9, UNIFORM_BLOCK - 7 + k, 5, p) for k in range(0, 20, 5)])
    assert np.array_equal(whole, pieces)


def test_close_stops_the_worker_processes_and_reading_goes_on_after_it():
    loader = mixture(workers=2)
    first = [next(loader) for _ in range(3)]
    workers = list(loader._stream._workers)  # type: ignore[union-attr]
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    loader.close()
    assert not any(w.is_alive() for w in workers)
    after = next(loader)  # new workers, from the same position
    reference = mixture()
    assert [torch.equal(a.inputs, next(reference).inputs) for a in first] == [True] * 3
    assert torch.equal(after.inputs, next(reference).inputs)
    loader.close()
    one_source().close()  # no workers: nothing to stop
