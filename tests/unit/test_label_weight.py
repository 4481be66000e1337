"""Every label of a step weighs the same: the pure parts of the token weighting (the counts
of a step's micro-batches and one label's weight given the step's total)."""

from __future__ import annotations

import pytest
import torch

from forge.data.batch import Batch
from forge.data.packing import IGNORE_INDEX
from forge.training.steps.common import label_counts, label_weight, step_label_weight, step_labels


def batch(labels: list[list[int]]) -> Batch:
    tensor = torch.tensor(labels)
    return Batch(torch.zeros_like(tensor), tensor)


X = IGNORE_INDEX


def test_label_counts_skip_the_ignored_labels():
    batches = [batch([[1, 2, X], [X, X, X]]), batch([[4, 5, 6], [7, X, 8]])]
    assert label_counts(batches).tolist() == [2.0, 5.0]


@pytest.mark.parametrize(
    ("total", "slices", "weight"),
    [
        (8.0, 1, 1 / 8),  # one rank: the mean over the step's labels
        (8.0, 2, 2 / 8),  # two ranks: the gradient average halves it back
        (1.0, 4, 4.0),
        (0.0, 1, 1.0),  # no labels anywhere: nothing to weigh, no division by zero
        (0.0, 2, 2.0),
    ],
)
def test_one_labels_weight_is_the_token_slices_over_the_steps_labels(total, slices, weight):
    assert label_weight(torch.tensor(total), slices).item() == pytest.approx(weight)


def test_the_shares_of_one_ranks_micro_batches_are_their_labels_over_the_steps():
    """One rank's micro-batches weigh their labels over the step's (summing to 1: a mean
    over every label); an all-masked micro-batch weighs nothing."""
    counts = label_counts([batch([[1, 2, 3]]), batch([[X, X, X]]), batch([[4, X, X]])])
    shares = counts * label_weight(step_labels(counts, 1, 1), 1)
    assert shares.tolist() == pytest.approx([0.75, 0.0, 0.25])


@pytest.mark.parametrize(
    ("groups", "weight"),
    [
        (None, 1 / 4),  # no replica groups: this rank's four labels
        (1, 1 / 4),  # one group takes part: alike
        (3, 1 / 12),  # three groups of four labels: each label one twelfth of the step
    ],
)
def test_under_replica_groups_a_label_weighs_over_every_participating_groups(groups, weight):
    """Each group's labels summed across the groups that take part (``across_groups``): a
    label weighs the same in every group, and a group's share is its labels' part."""
    counts = label_counts([batch([[1, 2, X], [3, 4, X]])])
    across = None if groups is None else (lambda labels: labels * groups)
    assert step_label_weight(counts, 1, 1, across).item() == pytest.approx(weight)
