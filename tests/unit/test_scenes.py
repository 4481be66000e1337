"""Procedural shapes: captions say what the pixels show, and the set is deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from forge.data.scenes import (
    BACKGROUND,
    COLORS,
    POSITIONS,
    Scene,
    Shape,
    caption,
    random_scene,
    render,
    shape_mask,
)


@pytest.mark.parametrize(
    ("scene", "text"),
    [
        (Scene((Shape("circle", "red", "small", "at the top left"),)),
         "a small red circle at the top left"),
        (Scene((Shape("square", "blue", "large", "in the center"),
                Shape("triangle", "yellow", "small", "at the bottom right"))),
         "a large blue square in the center and a small yellow triangle at the bottom right"),
    ],
)  # fmt: skip
def test_the_caption_names_each_shape_in_order(scene, text):
    assert caption(scene) == text


@pytest.mark.parametrize("kind", ["circle", "square", "triangle"])
@pytest.mark.parametrize("position", list(POSITIONS))
def test_a_shape_is_drawn_in_its_colour_at_its_position_and_nowhere_else(kind, position):
    size = 32
    shape = Shape(kind, "green", "small", position)
    image = render(Scene((shape,)), size)
    cx, cy = (int(c * size) for c in POSITIONS[position])
    assert tuple(image[cy, cx]) == COLORS["green"]  # the centre is inside every kind
    mask = shape_mask(shape, size)
    assert (image[~mask] == BACKGROUND).all()
    assert 5 < mask.sum() < size * size / 4  # a small shape: some pixels, not a quadrant


def test_large_is_larger_than_small():
    small = shape_mask(Shape("square", "red", "small", "in the center"), 32).sum()
    large = shape_mask(Shape("square", "red", "large", "in the center"), 32).sum()
    assert large > 2 * small


def test_scenes_are_deterministic_from_the_seed_and_positions_distinct():
    rng1, rng2 = np.random.default_rng(7), np.random.default_rng(7)
    first = [random_scene(rng1) for _ in range(200)]
    assert first == [random_scene(rng2) for _ in range(200)]
    other = np.random.default_rng(8)
    assert [random_scene(other) for _ in range(200)] != first
    assert len({caption(s) for s in first}) > 100  # varied
    for scene in first:
        assert 1 <= len(scene.shapes) <= 2
        assert len({s.position for s in scene.shapes}) == len(scene.shapes)
