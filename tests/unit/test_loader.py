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


def mixture(phases=(), workers=0, rank=0, world_size=1, grad_accum=1, sizes=(30, 50)):
    sources = [DataSource("a", "-", 3.0), DataSource("b", "-", 1.0)]
    sampling = Sampling(
        sizes=sizes,
        phases=resolve_phases(sources, phases, temperature=1.0),
        seed=11,
        batch_size=4,
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
    assert loader.state_dict() == {"micro_batch": 20, "cursors": [80]}


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
    assert loader.state_dict()["micro_batch"] == 3


def test_workers_read_the_same_batches_as_the_training_process():
    inline, workers = mixture(), mixture(workers=2)
    for _ in range(12):
        assert torch.equal(next(inline).inputs, next(workers).inputs)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0, "batch": 3}, "not one this forge writes"),
        ({"micro_batch": 3, "cursors": [1, 2, 3]}, "has 3 data sources, the config 2"),
    ],
)
def test_a_foreign_loader_state_is_refused(state, message):
    from forge.data.shards import DataError

    with pytest.raises(DataError, match=message):
        mixture().load_state_dict(state)


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
