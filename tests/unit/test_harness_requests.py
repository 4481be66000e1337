"""forge.harness.requests: the pure decisions of scoring lm-eval requests, as tables."""

from __future__ import annotations

import logging

import pytest

from forge.harness.requests import (
    GenerationArgs,
    Row,
    Share,
    batch_count,
    batches_of,
    cut_at_stop,
    flat_metrics,
    generation_args,
    length_order,
    padded_length,
    scored_row,
    split_whitespace,
)
from forge.harness.tasks import custom_dataset_note


@pytest.mark.parametrize(
    ("share", "n", "mine", "largest"),
    [
        (Share(0, 1), 5, [0, 1, 2, 3, 4], 5),
        (Share(0, 2), 5, [0, 2, 4], 3),
        (Share(1, 2), 5, [1, 3], 3),
        (Share(3, 4), 3, [], 1),  # an idle rank: it still runs its peers' forward count
        (Share(0, 2), 0, [], 0),
    ],
)
def test_a_share_is_every_count_th_request_from_its_index(share, n, mine, largest):
    assert share.of(n) == mine
    assert share.largest(n) == largest


@pytest.mark.parametrize(
    ("context", "continuation", "expected"),
    [
        ("Question: 2+2=", " 4", ("Question: 2+2=", " 4")),
        ("Answer: ", "yes", ("Answer:", " yes")),
        ("a\n\n", "b", ("a", "\n\nb")),
        ("", "x", ("", "x")),
    ],
)
def test_trailing_whitespace_moves_to_the_continuation(context, continuation, expected):
    assert split_whitespace(context, continuation) == expected


@pytest.mark.parametrize(
    ("context", "continuation", "max_len", "tokens", "scored"),
    [
        ([1, 2, 3], [4, 5], 8, (1, 2, 3, 4, 5), 2),
        ([1, 2, 3], [4, 5], 3, (2, 3, 4, 5), 2),  # the context is cut from the left
        ([1], [2, 3, 4, 5, 6], 3, (3, 4, 5, 6), 3),  # the continuation too once it overflows
    ],
)
def test_a_scored_row_fits_the_model_and_keeps_the_continuation(
    context, continuation, max_len, tokens, scored
):
    row = scored_row(context, continuation, max_len)
    assert row == Row(tokens, scored)
    assert len(row.inputs) <= max_len


def test_an_empty_continuation_is_refused():
    with pytest.raises(ValueError, match="empty continuation"):
        scored_row([1, 2], [], 8)


def test_rows_are_ordered_longest_first_and_ties_by_position():
    rows = [Row((1, 2), 1), Row((1, 2, 3, 4), 1), Row((5, 6), 1), Row((1, 2, 3), 1)]
    assert length_order(rows) == [1, 3, 0, 2]


@pytest.mark.parametrize(
    ("order", "size", "count", "expected"),
    [
        ([3, 1, 2], 2, None, [[3, 1], [2]]),
        ([3, 1, 2], 2, 3, [[3, 1], [2], []]),  # lockstep: padded to the busiest rank's count
        ([], 4, 2, [[], []]),
        ([0, 1, 2, 3], 4, None, [[0, 1, 2, 3]]),
    ],
)
def test_batches_are_cut_in_order_and_padded_for_lockstep(order, size, count, expected):
    assert batches_of(order, size, count) == expected


@pytest.mark.parametrize(
    ("n", "share", "size", "count"),
    [(10, Share(0, 1), 4, 3), (10, Share(1, 2), 4, 2), (3, Share(0, 4), 8, 1), (0, Share(), 8, 0)],
)
def test_the_lockstep_batch_count_is_the_busiest_shares(n, share, size, count):
    assert batch_count(n, share, size) == count


@pytest.mark.parametrize(("length", "multiple", "padded"), [(5, 1, 5), (5, 2, 6), (6, 2, 6)])
def test_rows_pad_to_the_tensor_parallel_multiple(length, multiple, padded):
    assert padded_length(length, multiple) == padded


@pytest.mark.parametrize(
    ("kwargs", "eos", "expected"),
    [
        ({"until": ["\n\n"], "max_gen_toks": 32}, None, GenerationArgs(("\n\n",), 32)),
        ({"until": "Q:"}, None, GenerationArgs(("Q:",), 256)),
        ({"until": ["x"]}, "</s>", GenerationArgs(("x", "</s>"), 256)),
        ({"do_sample": False, "temperature": 0.0}, None, GenerationArgs((), 256)),
    ],
)
def test_generation_arguments_of_a_request(kwargs, eos, expected):
    assert generation_args(kwargs, eos) == expected


@pytest.mark.parametrize("kwargs", [{"do_sample": True}, {"temperature": 0.7}])
def test_sampling_requests_are_refused(kwargs):
    with pytest.raises(ValueError, match="greedily"):
        generation_args(kwargs, None)


@pytest.mark.parametrize(
    ("text", "until", "cut"),
    [
        ("abc\n\ndef", ["\n\n"], "abc"),
        ("abc", ["\n\n"], "abc"),
        ("a.b;c", [";", "."], "a"),  # the earliest stop wins, whatever the order
        ("abc", [""], "abc"),
    ],
)
def test_generated_text_is_cut_at_the_first_stop(text, until, cut):
    assert cut_at_stop(text, until) == cut


def test_results_flatten_to_eval_task_metric_scalars():
    results = {
        "hellaswag": {
            "alias": "hellaswag",
            "acc,none": 0.5,
            "acc_stderr,none": 0.01,
            "acc_norm,none": 0.6,
            "sample_len": 100,
        },
        "gsm8k": {"exact_match,strict-match": 0.1, "exact_match,flexible-extract": 0.2},
        "broken": {"acc,none": float("nan"), "acc_stderr,none": "N/A", "flag,none": True},
    }
    assert flat_metrics(results) == {
        "eval/hellaswag/acc": 0.5,
        "eval/hellaswag/acc_norm": 0.6,
        "eval/gsm8k/exact_match_strict-match": 0.1,
        "eval/gsm8k/exact_match_flexible-extract": 0.2,
    }


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        ("stdlib: Custom kwargs can be passed to `--metadata` in console", False),
        ("metric acc is defined, but aggregation is not", True),
    ],
)
def test_only_lm_evals_custom_dataset_note_is_dropped(message, kept):
    record = logging.LogRecord("lm_eval", logging.WARNING, __file__, 1, message, None, None)
    assert custom_dataset_note(record) is kept


def test_scoring_seeds_like_lm_eval_and_leaves_the_runs_generators_as_they_were():
    import random

    import numpy as np
    import torch

    from forge.harness.tasks import random_state_kept

    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    def seeded(python: int, numpy: int, torch_seed: int) -> tuple[float, float, float]:
        random.seed(python)
        np.random.seed(numpy)
        torch.manual_seed(torch_seed)
        return draws()

    expected_inside = seeded(0, 1234, 1234)
    expected_after = seeded(7, 7, 7)
    seeded(7, 7, 7)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    with random_state_kept():
        inside = draws()
    assert inside == expected_inside  # the scores do not depend on when they are taken
    assert draws() == expected_after  # training goes on as if nothing had been drawn
