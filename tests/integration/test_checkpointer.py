"""The Checkpointer: at most one save in flight, commit only when durable, staged copies."""

import os

import torch

from forge.checkpoint.checkpointer import Checkpointer
from forge.checkpoint.store import load_checkpoint, step_dir
from forge.config import ModelConfig, OptimizerConfig
from forge.config.sections import AsyncMode
from forge.model.transformer import Transformer
from forge.optim import build_optimizer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def setup():
    torch.manual_seed(0)
    model = Transformer(CFG)
    return model, build_optimizer(model, OptimizerConfig())


def test_async_save_commits_only_in_wait(tmp_path):
    model, opt = setup()
    commits = []
    ck = Checkpointer(tmp_path, AsyncMode.ASYNC, 0, 1, on_commit=lambda s, p: commits.append(s))
    ck.save(1, model, opt, {"step": 1})
    assert ck.in_flight == 1
    assert not step_dir(tmp_path, 1).exists() and not (tmp_path / "latest").exists()
    assert ck.wait() == step_dir(tmp_path, 1)
    assert commits == [1] and os.readlink(tmp_path / "latest") == "step_1"
    assert ck.in_flight is None and ck.wait() is None


def test_next_save_waits_for_the_previous_one(tmp_path):
    model, opt = setup()
    ck = Checkpointer(tmp_path, AsyncMode.ASYNC, 0, 1)
    ck.save(1, model, opt, {"step": 1})
    ck.save(2, model, opt, {"step": 2})
    assert step_dir(tmp_path, 1).is_dir()  # committed by the second save
    assert ck.in_flight == 2
    ck.wait()
    assert os.readlink(tmp_path / "latest") == "step_2"


def test_async_save_holds_the_state_at_save_time(tmp_path):
    """The loop mutates the weights right after save() returns; the checkpoint must not see it."""
    model, opt = setup()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ck = Checkpointer(tmp_path, AsyncMode.ASYNC, 0, 1)
    ck.save(1, model, opt, {"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ck.wait()
    fresh = Transformer(CFG)
    load_checkpoint(step_dir(tmp_path, 1), fresh, None, restore_rng_state=False)
    for name, tensor in expected.items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_sync_save_commits_at_once(tmp_path):
    model, opt = setup()
    ck = Checkpointer(tmp_path, AsyncMode.DISABLED, 0, 1)
    ck.save(3, model, opt, {"step": 3})
    assert ck.in_flight is None and step_dir(tmp_path, 3).is_dir()
