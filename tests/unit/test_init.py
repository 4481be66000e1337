"""Initial values built region by region: any part equals that part of the full value, so a
shard computed alone is the shard of the one-process weights."""

from __future__ import annotations

import itertools

import pytest
import torch

from forge.model.init import TILE, local_region, seeded_normal, tiles_overlapping, whole

T = TILE


@pytest.mark.parametrize(
    ("shape", "region", "tiles"),
    [
        ((T, T), ((0, T), (0, T)), [((0, T), (0, T))]),  # exactly one tile
        ((T + 1, 3), ((0, T + 1), (0, 3)), [((0, T), (0, 3)), ((T, T + 1), (0, 3))]),
        ((3 * T, T), ((T - 1, T + 1), (0, 1)), [((0, T), (0, T)), ((T, 2 * T), (0, T))]),
        ((2 * T,), ((T, 2 * T),), [((T, 2 * T),)]),  # 1-D: tiles of TILE
        ((3, 2, 2), ((1, 3), (0, 2), (0, 2)), [((1, 2), (0, 2), (0, 2)), ((2, 3), (0, 2), (0, 2))]),
        ((10, 10), ((4, 4), (0, 10)), []),  # an empty shard (uneven split) draws nothing
    ],
    ids=["one-tile", "edge-row", "straddles", "1d", "experts-by-index", "empty"],
)
def test_a_region_overlaps_exactly_these_tiles(shape, region, tiles):
    assert tiles_overlapping(shape, region) == tiles


@pytest.mark.parametrize(
    ("shape", "region"),
    [
        ((600, 320), ((0, 150), (0, 320))),  # FSDP at 4 ranks: rows cut tiles
        ((600, 320), ((450, 600), (0, 320))),
        ((600, 320), ((0, 600), (160, 320))),  # row-parallel TP: a column shard
        ((600, 320), ((299, 301), (255, 257))),  # a corner of four tiles
        ((4, 320, 864), ((2, 4), (0, 320), (0, 864))),  # EP: half of the experts
        ((1000,), ((333, 667),)),
        ((7, 3), ((0, 0), (0, 3))),  # empty
    ],
)
def test_any_region_equals_that_part_of_the_full_value(shape, region):
    full = seeded_normal("layers.0.attention.wq.weight", shape, 0.02, seed=5)
    part = seeded_normal("layers.0.attention.wq.weight", shape, 0.02, seed=5, region=region)
    assert torch.equal(part, full[tuple(slice(a, b) for a, b in region)])


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_row_shards_of_any_count_join_into_the_same_weights(ranks):
    shape = (600, 320)
    full = seeded_normal("output.weight", shape, 1.0, seed=1)
    bounds = [round(i * shape[0] / ranks) for i in range(ranks + 1)]
    shards = [
        seeded_normal("output.weight", shape, 1.0, 1, ((a, b), (0, shape[1])))
        for a, b in itertools.pairwise(bounds)
    ]
    assert torch.equal(torch.cat(shards), full)


def test_the_values_depend_on_name_seed_and_tile():
    a = seeded_normal("w", (2 * T, 4), 1.0, seed=1)
    assert not torch.equal(a, seeded_normal("v", (2 * T, 4), 1.0, seed=1))
    assert not torch.equal(a, seeded_normal("w", (2 * T, 4), 1.0, seed=2))
    assert not torch.equal(a[:T], a[T:])  # each tile its own generator
    assert abs(float(a.std()) - 1.0) < 0.1


def test_a_plain_tensor_holds_all_of_its_value():
    assert local_region(torch.empty(3, 5)) == whole((3, 5)) == ((0, 3), (0, 5))
