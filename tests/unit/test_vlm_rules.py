"""Vision-language decisions that need no training: the config's keys and refusals, the
joint decoder's attention mask, where cross-attention layers go, how each parameter starts,
how captions become rows, and what a freeze schedule over the three parts trains when."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from forge.config import ConfigError, load_config
from forge.config.freeze import FreezeRule, schedule_problems, trainable_names
from forge.config.sections import ModelConfig, VisionConfig, VisionEncoderKind, VlmArch
from forge.data.batch import Batch
from forge.data.image_text import ImageCaptions, ImageSplit
from forge.data.packing import IGNORE_INDEX
from forge.model.vlm import (
    cross_attention_layers,
    prefix_causal_mask,
    vlm_initial_value,
)
from forge.training.setup.loaders import caption_cut_warning
from forge.training.setup.vlm import mismatched_images


def config_lines(tmp_path, *overrides: str) -> list[str]:
    path = tmp_path / "c.toml"
    path.write_text("[model]\ndim = 64\nn_heads = 4\n")
    try:
        load_config([str(path), *overrides])
    except ConfigError as exc:
        return exc.lines
    return []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--model.vlm=joint_decoder"], None),
        (["--model.vlm=cross_attention", "--model.vision.patch_size=8"], None),
        (["--model.vlm=joint"], "model.vlm"),
        (["--model.vlm=joint_decoder", "--model.vision.patch_size=5"],
         "model.vision.patch_size: must divide model.vision.image_size=32"),
        (["--model.vlm=joint_decoder", "--model.vision.dim=30"],
         "model.vision.dim: must be divisible by model.vision.n_heads=4"),
        (["--model.vlm=joint_decoder", "--model.vision.n_layers=0"], "model.vision.n_layers"),
        (["--model.vlm=joint_decoder", "--model.vision.cross_attention_every=0"],
         "model.vision.cross_attention_every"),
        (["--model.vlm=joint_decoder", "--model.vision.encoder=hf"],
         "model.vision.path: encoder='hf' needs a local folder"),
        (["--model.vision.dim=64"], "model.vlm: [model.vision] is set but model.vlm is not"),
        (["--model.vlm=joint_decoder", "--model.moe_num_experts=4"],
         "model.vlm: a vision-language model with mixture-of-experts blocks"),
        (["--model.vlm=joint_decoder", "--model.vision.image_size=x"], "model.vision.image_size"),
    ],
)  # fmt: skip
def test_vision_keys_are_checked_by_name(tmp_path, overrides, expected):
    lines = config_lines(tmp_path, *overrides)
    if expected is None:
        assert lines == []
    else:
        assert any(expected in line for line in lines), lines


def test_the_vision_keys_read_from_toml_as_a_nested_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[model]\ndim = 64\nn_heads = 4\nvlm = "cross_attention"\n\n'
        '[model.vision]\nencoder = "vit"\nimage_size = 16\npatch_size = 8\n'
    )
    model = load_config([str(path)]).config.model
    assert model.vlm is VlmArch.CROSS_ATTENTION
    assert model.vision == VisionConfig(VisionEncoderKind.VIT, image_size=16, patch_size=8)
    assert model.vision_config.num_patches == 4


@pytest.mark.parametrize(
    ("n_image", "n_text", "allowed"),
    [
        (0, 3, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),  # plain causal
        (2, 2, [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]),
        (3, 1, [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]),
    ],
)
def test_image_tokens_see_each_other_and_text_is_causal(n_image, n_text, allowed):
    mask = prefix_causal_mask(n_image, n_text, torch.device("cpu"))
    assert mask.tolist() == [[bool(x) for x in row] for row in allowed]


@pytest.mark.parametrize(
    ("n_layers", "every", "layers"),
    [(4, 2, (1, 3)), (4, 1, (0, 1, 2, 3)), (4, 4, (3,)), (5, 2, (1, 3)), (2, 3, ())],
)
def test_a_cross_attention_layer_follows_every_kth_block(n_layers, every, layers):
    cfg = ModelConfig(
        n_layers=n_layers,
        vlm=VlmArch.CROSS_ATTENTION,
        vision=VisionConfig(cross_attention_every=every),
    )
    assert cross_attention_layers(cfg) == layers


CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vlm=VlmArch.CROSS_ATTENTION)


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("vision_encoder.blocks.0.norm1.weight", "ones"),
        ("vision_encoder.norm.weight", "ones"),
        ("vision_encoder.blocks.0.qkv.bias", "zeros"),
        ("adapter.fc1.bias", "zeros"),
        ("cross_attention.1.attn_gate", "zeros"),
        ("cross_attention.1.ffn_gate", "zeros"),
        ("cross_attention.1.attention_norm.weight", "ones"),
        ("vision_encoder.patch_embed.weight", "normal"),
        ("adapter.fc2.weight", "normal"),
    ],
)
def test_each_vision_parameter_starts_by_its_rule(name, rule):
    value = vlm_initial_value(name, (64, 16), CFG, seed=0)
    if rule == "ones":
        assert torch.equal(value, torch.ones(64, 16))
    elif rule == "zeros":
        assert torch.equal(value, torch.zeros(64, 16))
    else:
        assert 0.015 < float(value.std()) < 0.025
        assert torch.equal(value, vlm_initial_value(name, (64, 16), CFG, seed=0))
        assert not torch.equal(value, vlm_initial_value(name, (64, 16), CFG, seed=1))


def test_the_decoder_starts_as_a_text_model_with_the_same_seed():
    from forge.model.init import initial_value

    for name in ("layers.0.attention.wo.weight", "tok_embeddings.weight", "norm.weight"):
        assert torch.equal(
            vlm_initial_value(f"decoder.{name}", (32, 32), CFG, seed=5),
            initial_value(name, (32, 32), CFG, seed=5),
        )


def captions_of(lengths: list[int], seq_len: int) -> ImageCaptions:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(1, offsets[-1] + 1, dtype=np.uint16)
    images = np.zeros((len(lengths), 2, 2, 3), dtype=np.uint8)
    return ImageCaptions(ImageSplit(images, offsets), tokens, seq_len)


@pytest.mark.parametrize(
    ("lengths", "index", "inputs", "labels"),
    [
        ([3, 5], 0, [1, 2, 3, 0], [2, 3, IGNORE_INDEX, IGNORE_INDEX]),  # padded
        ([3, 5], 1, [4, 5, 6, 7], [5, 6, 7, 8]),  # exactly seq_len + 1
        ([3, 7], 1, [4, 5, 6, 7], [5, 6, 7, 8]),  # cut after seq_len + 1 tokens
        ([1, 5], 0, [1, 0, 0, 0], [IGNORE_INDEX] * 4),  # nothing to predict
    ],
)
def test_a_caption_becomes_one_row_padded_or_cut(lengths, index, inputs, labels):
    got_inputs, got_labels = captions_of(lengths, seq_len=4).rows([index])
    assert got_inputs.tolist() == [inputs]
    assert got_labels.tolist() == [labels]


def test_mismatched_images_give_each_caption_another_rows_image():
    images = torch.arange(3).view(3, 1, 1, 1).expand(3, 2, 2, 3).to(torch.uint8)
    batch = Batch(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long))
    shuffled = mismatched_images(Batch(batch.inputs, batch.labels, images=images))
    assert shuffled.images is not None
    assert shuffled.images[:, 0, 0, 0].tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="no images"):
        mismatched_images(batch)


VLM_NAMES = (
    "vision_encoder.patch_embed.weight",
    "vision_encoder.blocks.0.qkv.weight",
    "adapter.fc1.weight",
    "adapter.fc2.weight",
    "decoder.tok_embeddings.weight",
    "decoder.layers.0.attention.wq.weight",
    "decoder.output.weight",
    "cross_attention.1.wq.weight",
)
# the vlm_debug preset's schedule: the adapter (and cross-attention) alone, then the decoder
# too from step 11, then the encoder as well from step 21
PRESET = (FreezeRule("vision_encoder", until_step=20), FreezeRule("decoder", until_step=10))
ADAPTER = {"adapter.fc1.weight", "adapter.fc2.weight", "cross_attention.1.wq.weight"}
DECODER = {n for n in VLM_NAMES if n.startswith("decoder.")}


@pytest.mark.parametrize(
    ("step", "trainable"),
    [
        (1, ADAPTER),
        (10, ADAPTER),
        (11, ADAPTER | DECODER),
        (20, ADAPTER | DECODER),
        (21, set(VLM_NAMES)),
    ],
)
def test_the_three_parts_unfreeze_by_the_schedule(step, trainable):
    assert schedule_problems(VLM_NAMES, PRESET) == []
    assert trainable_names(VLM_NAMES, PRESET, step) == trainable


@pytest.mark.parametrize(
    ("longest", "seq_len", "warned"),
    [(92, 96, False), (97, 96, False), (98, 96, True), (500, 96, True)],
)
def test_captions_longer_than_a_row_are_warned_about(longest, seq_len, warned):
    warning = caption_cut_warning(longest, seq_len, pathlib.Path("data/x"))
    assert (warning is not None) == warned
    if warning is not None:
        assert f"set train.seq_len >= {longest - 1}" in warning
        assert f"data/x's longest caption has {longest} tokens" in warning
