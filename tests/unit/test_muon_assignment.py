"""Distributed Muon's pure decisions: which rank owns each matrix, the rounds and buckets
they travel in, and each rank's shard of a dimension."""

from __future__ import annotations

import pytest
import torch

from forge.optim.muon_dist import assign_owners, buckets, ns_flops, rounds, shard_sizes

# (costs, world, owners): largest first, each to the least loaded rank, ties to the lower rank
ASSIGNMENTS = [
    ([], 2, ()),
    ([5], 2, (0,)),
    ([5], 1, (0,)),
    ([3, 3, 3], 2, (0, 1, 0)),  # equal costs: by index
    ([1, 2, 3, 4], 2, (0, 1, 1, 0)),  # 4→0, 3→1, 2→1 (3 < 4), 1→0
    ([10, 1, 1, 1, 1, 1], 2, (0, 1, 1, 1, 1, 1)),  # one big matrix: the rest go to rank 1
    ([4, 4, 4, 4, 4], 4, (0, 1, 2, 3, 0)),  # not a multiple of the world: rank 0 gets two
    ([2, 7, 7, 2], 3, (2, 0, 1, 2)),
    ([1, 1], 4, (0, 1)),  # more ranks than matrices: ranks 2 and 3 own none
]


@pytest.mark.parametrize("costs,world,owners", ASSIGNMENTS)
def test_each_matrix_goes_to_the_least_loaded_rank_largest_first(costs, world, owners):
    assert assign_owners(costs, world) == owners


def test_the_debug_models_matrices_split_within_one_matrix_of_even():
    """4 layers of wq, wk, wv, wo (256², 128 × 256) and w1, w2, w3 (704 × 256)."""
    shapes = [(256, 256), (128, 256), (128, 256), (256, 256), (704, 256), (256, 704), (704, 256)]
    costs = [ns_flops(s, 5) for s in shapes * 4]
    for world in (2, 3, 4):
        owners = assign_owners(costs, world)
        loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
        assert max(loads) - min(loads) <= max(costs)
        assert max(loads) / (sum(costs) / world) < 1.15, loads


@pytest.mark.parametrize(
    "shape,steps,flops",
    [
        ((4, 8), 1, 2 * (2 * 16 * 8 + 64)),  # the gram, the gram squared, the product with x
        ((8, 4), 1, 2 * (2 * 16 * 8 + 64)),  # a tall matrix iterates on its transpose
        ((4, 8), 5, 5 * 2 * (2 * 16 * 8 + 64)),
    ],
)
def test_the_cost_is_the_newton_schulz_flops(shape, steps, flops):
    assert ns_flops(shape, steps) == flops


# (owners, costs, world, rounds): round r holds the r-th matrix (largest first) of each rank
ROUNDS = [
    ((), [], 2, []),
    ((0, 1, 1, 0), [1, 2, 3, 4], 2, [[2, 3], [0, 1]]),
    ((0, 1, 2, 3, 0), [4, 4, 4, 4, 4], 4, [[0, 1, 2, 3], [4]]),
    ((0, 1, 1, 1), [10, 1, 1, 1], 2, [[0, 1], [2], [3]]),
]


@pytest.mark.parametrize("owners,costs,world,expected", ROUNDS)
def test_round_r_holds_each_ranks_r_th_matrix(owners, costs, world, expected):
    assert rounds(owners, costs, world) == expected


# (rounds, numels, limit, buckets): whole rounds, a bucket closing once it holds the limit
BUCKETS = [
    ([], [], 10, []),
    ([[0, 1], [2, 3]], [4, 4, 4, 4], 100, [[0, 1, 2, 3]]),  # everything fits: one bucket
    ([[0, 1], [2, 3]], [4, 4, 4, 4], 8, [[0, 1], [2, 3]]),  # each round reaches the limit
    ([[0, 1], [2, 3], [4]], [4, 4, 1, 1, 1], 5, [[0, 1], [2, 3, 4]]),
    ([[1, 0]], [50, 50], 10, [[0, 1]]),  # a round over the limit still travels whole
]


@pytest.mark.parametrize("by_round,numels,limit,expected", BUCKETS)
def test_buckets_are_whole_rounds_up_to_the_limit(by_round, numels, limit, expected):
    assert buckets(by_round, numels, limit) == expected


@pytest.mark.parametrize(
    "length,world",
    [(8, 2), (7, 2), (5, 4), (1, 2), (3, 4), (10, 3), (256, 4), (0, 2)],
)
def test_shard_sizes_are_torch_chunks(length, world):
    """DTensor's ``Shard`` splits like ``torch.chunk``, padded with empty shards."""
    chunks = [len(c) for c in torch.arange(length).chunk(world)] if length else []
    assert shard_sizes(length, world) == chunks + [0] * (world - len(chunks))
