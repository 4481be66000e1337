"""A vision-language run end to end: scripts/train.py trains each architecture through its
freeze schedule, resumes bit-exactly across a transition, refuses what it cannot do in one
line, and scripts/generate.py captions an image with the result."""

from __future__ import annotations

import json
import pathlib
import shutil
from unittest import mock

import numpy as np
import pytest
import torch

from forge.checkpoint.store import load_checkpoint
from forge.config import load_config
from forge.data.scenes import Scene, Shape, render
from forge.model.vlm import build_model
from tests.conftest import tiny_vlm_config
from tests.e2e.test_train_script import TRAIN, load_script, run_dir

GENERATE = load_script("generate")
EVAL = load_script("eval")
CONVERT = load_script("convert_checkpoint")

# the adapter (and cross-attention layers) alone for steps 1-2, the decoder too from step 3,
# the encoder as well from step 5
SCHEDULE = """
[[freeze]]
module = "vision_encoder"
until_step = 4

[[freeze]]
module = "decoder"
until_step = 2

[eval]
interval = 6
steps = 2
"""


def vlm_run(folder: pathlib.Path, data: pathlib.Path, arch: str = "joint_decoder") -> pathlib.Path:
    config = tiny_vlm_config(folder, data, arch)
    config.write_text(config.read_text().replace("max_steps = 12", "max_steps = 6") + SCHEDULE)
    return config


def metrics(config: pathlib.Path, key: str) -> list[dict]:
    lines = (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


def final_weights(config: pathlib.Path, step: int) -> dict[str, torch.Tensor]:
    model = build_model(load_config([str(config)]).config.model)
    load_checkpoint(run_dir(config) / "checkpoints" / f"step_{step}", model, None)
    return model.state_dict()


@pytest.mark.parametrize("arch", ["joint_decoder", "cross_attention"])
def test_a_vlm_run_trains_through_its_freeze_stages(tmp_path, small_shapes, arch):
    config = vlm_run(tmp_path, small_shapes, arch)
    assert TRAIN.main([str(config)]) == 0
    steps = metrics(config, "loss")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r["images_per_sec"] > 0 and r["tokens_per_sec"] > 0 for r in steps)
    assert all(np.isfinite(r["loss"]) for r in steps)
    stages = {r["step"]: r["params/frozen"] for r in metrics(config, "params/trainable")}
    assert sorted(stages) == [1, 3, 5] and stages[1] > stages[3] > stages[5] == 0
    assert [r["step"] for r in metrics(config, "eval/loss")] == [6]
    weights = final_weights(config, 6)
    assert any(name.startswith("vision_encoder.") for name in weights)
    if arch == "cross_attention":  # the gates moved off zero: the image is let in
        assert float(weights["cross_attention.0.attn_gate"].abs()) > 0


def test_a_vlm_run_resumed_at_a_freeze_transition_is_bit_exact(tmp_path, small_shapes):
    """The checkpoint at step 2 holds optimizer state for the adapter only; step 3 adds the
    decoder's parameters with fresh state."""
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    whole = vlm_run(tmp_path / "whole", small_shapes)
    split = vlm_run(tmp_path / "split", small_shapes)
    fixed = ["--scheduler.warmup_steps=1", "--scheduler.decay_steps=8"]  # as stops vary
    assert TRAIN.main([str(whole), *fixed]) == 0
    assert TRAIN.main([str(split), *fixed, "--train.max_steps=2", "--checkpoint.interval=2"]) == 0
    assert TRAIN.main([str(split), *fixed]) == 0
    assert [r["loss"] for r in metrics(split, "loss")] == [
        r["loss"] for r in metrics(whole, "loss")
    ]
    a, b = final_weights(whole, 6), final_weights(split, 6)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def write_png(path: pathlib.Path, image: np.ndarray) -> pathlib.Path:
    pil = pytest.importorskip("PIL.Image")
    pil.fromarray(image).save(path)
    return path


def test_generate_captions_an_image_and_refuses_what_does_not_fit(tmp_path, small_shapes, capsys):
    config = vlm_run(tmp_path, small_shapes)
    short = ["--train.max_steps=2", "--scheduler.warmup_steps=1", "--eval.interval=0"]
    assert TRAIN.main([str(config), *short]) == 0
    picture = render(Scene((Shape("circle", "red", "large", "in the center"),)), 16)
    png = write_png(tmp_path / "red.png", picture)
    capsys.readouterr()
    assert GENERATE.main([str(run_dir(config)), "--image", str(png), "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert "# captioned" in out.err and out.out.strip()  # 8 greedy bytes of a caption
    assert GENERATE.main([str(run_dir(config))]) == 2
    assert "--image: the run is a vision-language model" in capsys.readouterr().err
    missing = tmp_path / "missing.png"
    assert GENERATE.main([str(run_dir(config)), "--image", str(missing)]) == 2
    assert f"{missing}: image file not found" in capsys.readouterr().err
    with mock.patch("importlib.util.find_spec", return_value=None):  # Pillow not installed
        assert GENERATE.main([str(run_dir(config)), "--image", str(png)]) == 2
    assert "--image: reading an image needs Pillow; pip install -e '.[vision]'" in (
        capsys.readouterr().err
    )
    out_dir = tmp_path / "export"
    assert CONVERT.main(["export", str(run_dir(config)), "--out", str(out_dir)]) == 2
    assert "has no Hugging Face export" in capsys.readouterr().err and not out_dir.exists()


def test_eval_takes_every_held_out_caption_with_its_image(tmp_path, small_shapes, capsys):
    config = vlm_run(tmp_path, small_shapes)
    assert TRAIN.main([str(config), "--eval.interval=2"]) == 0
    logged = metrics(config, "eval/loss")[-1]["eval/loss"]  # 2 batches of 4 of the 40 captions
    capsys.readouterr()
    assert EVAL.main([str(run_dir(config)), "--json"]) == 0
    matched = json.loads(capsys.readouterr().out)
    assert matched["tokens"] > 0 and abs(matched["loss"] - logged) < 0.5
    assert EVAL.main([str(run_dir(config)), "--json", "--mismatched-images"]) == 0
    mismatched = json.loads(capsys.readouterr().out)
    assert mismatched["tokens"] == matched["tokens"]
    assert mismatched["loss"] != matched["loss"]  # the images reach the model


def test_a_text_run_refuses_an_image(tiny_config, tmp_path, capsys):
    assert TRAIN.main([str(tiny_config), "--train.max_steps=2", "--scheduler.warmup_steps=1"]) == 0
    png = write_png(tmp_path / "x.png", np.zeros((8, 8, 3), dtype=np.uint8))
    capsys.readouterr()
    assert GENERATE.main([str(run_dir(tiny_config)), "--image", str(png)]) == 2
    assert "--image: the run is a text model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.vision.image_size=32", "--model.vision.patch_size=8"],
         "model.vision.image_size: 32, but"),
        (["--model.max_seq_len=100"],
         "model.max_seq_len: the joint decoder runs 16 image tokens + train.seq_len=96"),
        (["--data.pack_documents=true"], "data.pack_documents: is not supported with a vision"),
        (["--checkpoint.export_final=true"], "checkpoint.export_final: is not supported"),
        (["--model.vision.encoder=hf", "--model.vision.path=/nonexistent"],
         "model.vision.path: /nonexistent holds no config.json"),
        (["--data.path={text}"], "data.path: "),
    ],
)  # fmt: skip
def test_what_a_vlm_run_cannot_do_is_one_line_and_leaves_no_run_dir(
    tmp_path, small_shapes, small_corpus, capsys, overrides, message
):
    config = tiny_vlm_config(tmp_path, small_shapes)
    args = [o.format(text=small_corpus) for o in overrides]
    assert TRAIN.main([str(config), *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not run_dir(config).exists()


def test_a_nan_at_a_freeze_transition_is_skipped_and_the_weights_stay(
    tmp_path, small_shapes, monkeypatch
):
    """Step 3 adds the decoder to the optimizer; a NaN loss there skips the update (every
    weight stays as after step 2) and the run goes on, the decoder training from step 4."""
    monkeypatch.setenv("FORGE_FAULTS", "nan:step=3")
    config = vlm_run(tmp_path, small_shapes)
    keep = ["--checkpoint.interval=1", "--checkpoint.keep_last_n=10"]
    assert TRAIN.main([str(config), *keep]) == 0
    losses = [r["loss"] for r in metrics(config, "loss")]
    assert len(losses) == 6 and np.isnan(losses[2])
    assert all(np.isfinite(x) for i, x in enumerate(losses) if i != 2)
    second, third, fourth = (final_weights(config, s) for s in (2, 3, 4))
    assert all(torch.equal(second[n], third[n]) for n in second)
    assert any(not torch.equal(third[n], fourth[n]) for n in third if n.startswith("decoder."))


def test_a_truncated_image_file_is_named_and_nothing_is_written(tmp_path, small_shapes, capsys):
    data = tmp_path / "shapes"
    shutil.copytree(small_shapes, data)
    images = data / "train_images.bin"
    images.write_bytes(images.read_bytes()[:-100])
    config = tiny_vlm_config(tmp_path, data)
    assert TRAIN.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{images}: missing or not" in err and "truncated" in err
    assert "Traceback" not in err
    assert not run_dir(config).exists()
