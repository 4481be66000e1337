"""Which attention backend runs, as a table; the model.attention / model.sliding_window
config rows; how documents are cut into segments."""

from __future__ import annotations

import pytest
import torch

from forge.config import ConfigError, ModelConfig, load_config
from forge.config.model import AttentionBackend
from forge.model.attention import (
    FLEX_ON_CPU,
    VARLEN_FP32,
    VARLEN_OFF_CUDA,
    Backend,
    attention_problem,
    choose_backend,
    document_segments,
    padded_length,
)

A = AttentionBackend
# (device, packed, model.attention, sliding window) -> backend
CHOICES = [
    ("cpu", False, A.AUTO, 0, Backend.CAUSAL),
    ("cpu", True, A.AUTO, 0, Backend.SEGMENTS),  # the CPU trains through SDPA
    ("cpu", False, A.SDPA, 0, Backend.CAUSAL),
    ("cpu", True, A.SDPA, 0, Backend.SEGMENTS),
    ("cpu", True, A.AUTO, 8, Backend.DENSE_MASK),  # a window: SDPA needs the mask
    ("cpu", False, A.AUTO, 8, Backend.DENSE_MASK),
    ("cpu", True, A.FLEX, 0, Backend.FLEX),  # as asked (its forward runs on a CPU)
    ("cpu", True, A.VARLEN, 0, Backend.VARLEN),  # as asked: refused when the mask is built
    ("cuda", False, A.AUTO, 0, Backend.CAUSAL),
    ("cuda", True, A.AUTO, 0, Backend.FLEX),
    ("cuda", False, A.AUTO, 8, Backend.FLEX),
    ("cuda", True, A.AUTO, 8, Backend.FLEX),
    ("cuda", False, A.SDPA, 0, Backend.CAUSAL),
    ("cuda", True, A.SDPA, 0, Backend.DENSE_MASK),  # per document would sync the device
    ("cuda", True, A.SDPA, 8, Backend.DENSE_MASK),
    ("cuda", False, A.FLEX, 0, Backend.FLEX),
    ("cuda", True, A.VARLEN, 0, Backend.VARLEN),
    ("cuda", False, A.VARLEN, 8, Backend.VARLEN),
    ("mps", True, A.AUTO, 0, Backend.DENSE_MASK),  # another accelerator: no host boundaries
    ("mps", False, A.AUTO, 0, Backend.CAUSAL),
]


@pytest.mark.parametrize("device,packed,configured,window,expected", CHOICES)
def test_backend_choice_table(device, packed, configured, window, expected):
    assert choose_backend(device, packed, configured, window) is expected


# (model.attention, device, bf16, training) -> the refusal, or None
PROBLEMS = [
    (A.AUTO, "cpu", False, True, None),
    (A.SDPA, "cpu", False, True, None),
    (A.FLEX, "cpu", False, True, FLEX_ON_CPU),
    (A.FLEX, "cpu", False, False, None),  # evaluation and generation: forward only
    (A.FLEX, "cuda", False, True, None),
    (A.VARLEN, "cpu", True, True, VARLEN_OFF_CUDA),
    (A.VARLEN, "cuda", False, True, VARLEN_FP32),
    (A.VARLEN, "cuda", True, True, None),
]


@pytest.mark.parametrize("configured,device,bf16,training,expected", PROBLEMS)
def test_what_a_device_cannot_run_is_named(configured, device, bf16, training, expected):
    cfg = ModelConfig(attention=configured)
    assert attention_problem(cfg, device, bf16, training) == expected
    if expected is not None:
        assert expected.startswith("model.attention=") and "\n" not in expected


def test_the_default_is_auto_without_a_window():
    cfg = ModelConfig()
    assert cfg.attention is A.AUTO and cfg.sliding_window == 0


# overrides -> the one line that refuses them
REFUSALS = [
    (
        ["--model.attention=dense"],
        "model.attention: expected one of 'auto', 'sdpa', 'flex', 'varlen', got 'dense'",
    ),
    (["--model.sliding_window=-1"], "model.sliding_window: must be >= 0, got -1"),
    (["--model.vlm=joint_decoder", "--model.attention=flex"], "model.attention: 'flex' is not"),
    (["--model.vlm=joint_decoder", "--model.sliding_window=4"], "model.sliding_window: is not"),
]


@pytest.mark.parametrize("overrides,line", REFUSALS)
def test_config_refuses_in_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as err:
        load_config(["configs/train/debug.toml", *overrides])
    lines = [x for x in str(err.value).splitlines() if x.startswith(line.split(":")[0])]
    assert len(lines) == 1 and lines[0].startswith(line), str(err.value)


@pytest.mark.parametrize("value", ["auto", "sdpa", "flex", "varlen"])
def test_config_accepts_every_backend(value):
    args = [f"--model.attention={value}", "--model.sliding_window=16"]
    config = load_config(["configs/train/debug.toml", *args]).config
    assert config.model.attention is AttentionBackend(value)
    assert config.model.sliding_window == 16


@pytest.mark.parametrize(
    "n,padded", [(1, 1), (2, 2), (3, 4), (17, 32), (63, 64), (64, 64), (65, 65), (4096, 4096)]
)
def test_short_segments_pad_to_a_power_of_two_long_ones_do_not(n, padded):
    assert padded_length(n) == padded


def ids_of(*rows: list[int]) -> torch.Tensor:
    """Document ids of rows given as document lengths."""
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in rows])


def test_segments_group_by_padded_length_and_put_every_token_back():
    ids = ids_of([3, 5, 100], [1, 3, 104])  # rows of 108
    seg = document_segments(ids)
    assert seg is not None
    shapes = [tuple(g.index.shape) for g in seg.groups]
    assert shapes == [(1, 1), (2, 4), (1, 8), (1, 100), (1, 104)]
    padded = seg.groups[1]  # lengths 3 and 3 at 4: one padding slot each, repeating the last
    assert padded.index.tolist() == [[0, 1, 2, 2], [109, 110, 111, 111]]
    assert padded.keep is not None and padded.keep.tolist() == [0, 1, 2, 4, 5, 6]
    assert seg.groups[3].keep is None  # 100 long: no padding
    real = torch.cat(
        [g.index.flatten() if g.keep is None else g.index.flatten()[g.keep] for g in seg.groups]
    )
    assert torch.equal(real[seg.inverse], torch.arange(ids.numel()))


def test_rows_of_one_document_each_are_plain_causal():
    assert document_segments(torch.zeros(3, 16, dtype=torch.long)) is None
    assert document_segments(ids_of([16], [16])) is None
    assert document_segments(ids_of([15, 1], [16])) is not None
