"""Image–caption datasets and scripts/prepare_vlm_data.py: written atomically, read back
checked, deterministic, and bad input refused in one line."""

from __future__ import annotations

import importlib.util
import itertools
import json
import pathlib

import numpy as np
import pytest

from forge.data.image_text import image_size_of, open_images, write_image_text_dataset
from forge.data.scenes import COLORS
from forge.data.shards import DataError, open_split, read_manifest
from forge.data.tokenizer import ByteTokenizer
from tests.conftest import REPO

PREPARE = REPO / "scripts" / "prepare_vlm_data.py"


def prepare(*args: str) -> int:
    spec = importlib.util.spec_from_file_location("prepare_vlm_data", PREPARE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(args))


def captions(folder: pathlib.Path, split: str) -> list[str]:
    tokens = np.concatenate(open_split(folder, read_manifest(folder), split, True))
    offsets = open_images(folder, split).offsets
    return [
        bytes(tokens[a + 1 : b - 1].astype(np.uint8)).decode()
        for a, b in itertools.pairwise(offsets)
    ]


def test_the_procedural_set_is_deterministic_and_its_captions_match_its_images(tmp_path):
    assert prepare("--out", str(tmp_path / "a"), "--n", "300", "--seed", "3") == 0
    assert prepare("--out", str(tmp_path / "b"), "--n", "300", "--seed", "3") == 0
    for name in ("train_images.bin", "train_00000.bin", "validation_images.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    folder = tmp_path / "a"
    train, held_out = open_images(folder, "train"), open_images(folder, "validation")
    assert (len(train), len(held_out)) == (285, 15)  # --validation-percent 5
    assert image_size_of(folder) == 32 and train.images.shape == (285, 32, 32, 3)
    for image, text in zip(train.images[:50], captions(folder, "train")[:50], strict=True):
        named = {c for c in COLORS if f" {c} " in f" {text} "}
        drawn = {c for c, rgb in COLORS.items() if (image == rgb).all(-1).any()}
        assert named == drawn, text  # every colour named is drawn, and only those


def test_pairs_round_trip_and_bad_images_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), f"caption {i}") for i in range(5)]
    write_image_text_dataset(tmp_path / "d", {"train": pairs}, ByteTokenizer(), 8, "test")
    split = open_images(tmp_path / "d", "train")
    assert all(np.array_equal(split.images[i], pairs[i][0]) for i in range(5))
    assert captions(tmp_path / "d", "train") == [t for _, t in pairs]
    with pytest.raises(DataError, match=r"image 1 of split 'train': uint8 \(4, 4, 3\)"):
        bad = [pairs[0], (np.zeros((4, 4, 3), np.uint8), "x")]
        write_image_text_dataset(tmp_path / "e", {"train": bad}, ByteTokenizer(), 8, "test")
    assert not (tmp_path / "e").exists()  # nothing half-written


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:-10]), "not 960 bytes as the manifest says"),
        (lambda f: f.write_bytes(b"\xff" + f.read_bytes()[1:]), "checksum differs"),
        (lambda f: f.unlink(), "missing or not 960 bytes"),
    ],
    ids=["truncated", "modified", "missing"],
)
def test_a_damaged_image_file_is_refused_naming_it(tmp_path, damage, fragment):
    pairs = [(np.full((8, 8, 3), i, np.uint8), f"c{i}") for i in range(5)]
    write_image_text_dataset(tmp_path / "d", {"train": pairs}, ByteTokenizer(), 8, "test")
    damage(tmp_path / "d" / "train_images.bin")
    with pytest.raises(DataError, match=r"train_images\.bin") as info:
        open_images(tmp_path / "d", "train")
    assert fragment in str(info.value)


def test_a_text_dataset_is_not_an_image_dataset(small_corpus):
    with pytest.raises(DataError, match="not an image–caption dataset"):
        image_size_of(small_corpus)


def test_a_folder_and_a_jsonl_of_real_images(tmp_path):
    pil = pytest.importorskip("PIL.Image")
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    for i in range(12):
        pil.fromarray(np.full((20, 30, 3), i * 20, np.uint8)).save(pairs / f"img{i}.png")
        (pairs / f"img{i}.txt").write_text(f"a grey picture {i}\n")
    assert prepare("--input", str(pairs), "--out", str(tmp_path / "f"), "--image-size", "16",
                   "--validation-percent", "30") == 0  # fmt: skip
    train, held = open_images(tmp_path / "f", "train"), open_images(tmp_path / "f", "validation")
    assert len(train) + len(held) == 12 and len(held) > 0
    assert train.images.shape[1:] == (16, 16, 3)
    lines = [json.dumps({"image_path": f"pairs/img{i}.png", "caption": f"c{i}"}) for i in range(3)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    assert prepare("--input", str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "j"),
                   "--validation-percent", "50") == 0  # fmt: skip


@pytest.mark.parametrize(
    ("setup", "args", "line"),
    [
        (None, ["--n", "0"], "--n: must be > 0, got 0"),
        (None, ["--image-size", "2"], "--image-size: must be in [4, 1024], got 2"),
        (None, ["--validation-percent", "0"], "--validation-percent: must be in (0, 100)"),
        (None, ["--validation-percent", "nan"], "--validation-percent: must be in (0, 100)"),
        (None, ["--seed", "-1"], "--seed: must be in [0, 4293967293), got -1"),
        ("orphan", [], "orphan.png: no caption file orphan.txt beside it"),
        ("jsonl", [], ":1: expected a JSON object with image_path and caption"),
        ("missing", [], "gone.png: image file not found"),
        ("garbage", [], "bad.png: not a readable image"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, args, line):
    pytest.importorskip("PIL")
    inputs: list[str] = []
    if setup == "orphan":
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "orphan.png").write_bytes(b"")
        inputs = ["--input", str(tmp_path / "in")]
    elif setup in ("jsonl", "missing"):
        row = (
            "not json"
            if setup == "jsonl"
            else json.dumps({"image_path": "gone.png", "caption": "x"})
        )
        (tmp_path / "in.jsonl").write_text(row + "\n")
        inputs = ["--input", str(tmp_path / "in.jsonl")]
    elif setup == "garbage":
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "bad.png").write_bytes(b"not a png")
        (tmp_path / "in" / "bad.txt").write_text("x")
        inputs = ["--input", str(tmp_path / "in"), "--validation-percent", "99"]
    assert prepare(*inputs, *args, "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert not (tmp_path / "out").exists()


def test_reading_images_without_pillow_names_the_extra(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a)
    )
    (tmp_path / "in").mkdir()
    assert prepare("--input", str(tmp_path / "in"), "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --input: reading images needs Pillow; pip install -e '.[vision]'"]


def test_an_unwritable_out_is_one_line_and_leaves_nothing(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file where the dataset folder would go")
    assert prepare("--out", str(tmp_path / "taken"), "--n", "20") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "cannot write the dataset" in err[0], err
    assert (tmp_path / "taken").read_text().startswith("a file")  # not replaced
    assert not (tmp_path / "taken.tmp").exists()
