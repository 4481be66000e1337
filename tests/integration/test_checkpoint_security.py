"""A checkpoint carrying pickled code, or pointing outside its directory, is refused unrun."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from forge.checkpoint.checkpointer import save_checkpoint
from forge.checkpoint.safety import UnsafeCheckpointError, read_metadata_safely
from forge.checkpoint.store import load_checkpoint
from forge.config import ModelConfig, OptimizerConfig
from forge.model.transformer import Transformer
from forge.optim import build_optimizer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)


class Payload:
    """Unpickling this runs a shell command: what an attacker would plant."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = build_optimizer(model, OptimizerConfig())
    return save_checkpoint(tmp_path / "ckpt", 1, model, opt, {"step": 1}), model, opt


def test_metadata_with_a_code_payload_is_refused_without_running_it(checkpoint, tmp_path):
    path, model, opt = checkpoint
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match="refusing to load it"):
        load_checkpoint(path, model, opt)
    assert not marker.exists()


def test_rng_file_with_a_code_payload_is_refused_without_running_it(checkpoint, tmp_path):
    path, model, opt = checkpoint
    marker = tmp_path / "pwned"
    (path / "rng_rank0.pt").write_bytes(pickle.dumps({"torch_cpu": Payload(marker)}))
    with pytest.raises(UnsafeCheckpointError, match="more than tensors"):
        load_checkpoint(path, model, opt)
    assert not marker.exists()


@pytest.mark.parametrize("escape", ["../outside.distcp", "/etc/passwd"])
def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(checkpoint, escape):
    path, model, opt = checkpoint
    meta = read_metadata_safely(path)
    for info in meta.storage_data.values():
        info.relative_path = escape
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        load_checkpoint(path, model, opt)


def test_genuine_metadata_passes(checkpoint):
    path, model, opt = checkpoint
    assert read_metadata_safely(path).state_dict_metadata
    load_checkpoint(path, model, opt)
