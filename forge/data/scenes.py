"""Procedural images of coloured shapes with captions that describe them: an image–caption
set that needs no download (``scripts/prepare_vlm_data.py``).

A scene holds one or two shapes, each a kind, a colour, a size and one of five positions (no
two at the same place); its caption names them in order, e.g. "a small red circle at the top
left and a large blue square in the center". Rendering is plain NumPy: a pure function of the
scene and the image size.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "cyan": (40, 210, 220),
}
KINDS = ("circle", "square", "triangle")
SIZES: dict[str, float] = {"small": 0.12, "large": 0.22}  # half-extent, a fraction of the side
POSITIONS: dict[str, tuple[float, float]] = {  # centre (x, y), fractions of the side
    "at the top left": (0.25, 0.25),
    "at the top right": (0.75, 0.25),
    "at the bottom left": (0.25, 0.75),
    "at the bottom right": (0.75, 0.75),
    "in the center": (0.5, 0.5),
}
BACKGROUND = (16, 16, 16)


@attrs.frozen
class Shape:
    kind: str
    color: str
    size: str
    position: str


@attrs.frozen
class Scene:
    shapes: tuple[Shape, ...]


def random_scene(rng: np.random.Generator) -> Scene:
    """One or two shapes at distinct positions, every attribute uniform."""
    count = int(rng.integers(1, 3))
    places = rng.choice(len(POSITIONS), size=count, replace=False)
    names = list(POSITIONS)
    shapes = tuple(
        Shape(
            kind=KINDS[int(rng.integers(len(KINDS)))],
            color=list(COLORS)[int(rng.integers(len(COLORS)))],
            size=list(SIZES)[int(rng.integers(len(SIZES)))],
            position=names[int(p)],
        )
        for p in places
    )
    return Scene(shapes)


def caption(scene: Scene) -> str:
    """The scene in words: "a <size> <colour> <kind> <position>", joined by "and"."""
    return " and ".join(f"a {s.size} {s.color} {s.kind} {s.position}" for s in scene.shapes)


def shape_mask(shape: Shape, size: int) -> np.ndarray:
    """The pixels ``(size, size)`` a shape covers."""
    cx, cy = (c * size for c in POSITIONS[shape.position])
    r = SIZES[shape.size] * size
    y, x = np.mgrid[0:size, 0:size] + 0.5  # pixel centres
    if shape.kind == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r**2
    if shape.kind == "square":
        return (np.abs(x - cx) <= r) & (np.abs(y - cy) <= r)
    # triangle, apex up: narrow at the top, 2r wide at the bottom
    inside_rows = (y >= cy - r) & (y <= cy + r)
    return inside_rows & (np.abs(x - cx) <= (y - (cy - r)) / 2)


def render(scene: Scene, size: int) -> np.ndarray:
    """The scene as an RGB ``uint8`` image ``(size, size, 3)`` on a dark background."""
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for shape in scene.shapes:
        image[shape_mask(shape, size)] = COLORS[shape.color]
    return image


def procedural_pairs(n: int, size: int, seed: int) -> Iterator[tuple[np.ndarray, str]]:
    """``n`` scenes from one generator seeded with ``seed``, rendered and captioned."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        scene = random_scene(rng)
        yield render(scene, size), caption(scene)
