"""The Checkpointer: at most one save in flight, commit only when durable, staged copies."""

import os

import pytest
import torch

from forge.checkpoint.checkpointer import Checkpointer
from forge.checkpoint.store import load_checkpoint, step_dir
from forge.config import ModelConfig, OptimizerConfig
from forge.config.sections import AsyncMode
from forge.model.transformer import Transformer
from forge.optim import build_optimizer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)


ASYNC_MODES = [AsyncMode.ASYNC, AsyncMode.ASYNC_PROCESS]


def setup():
    torch.manual_seed(0)
    model = Transformer(CFG)
    return model, build_optimizer(model, OptimizerConfig())


@pytest.fixture
def checkpointer(request, tmp_path):
    """A Checkpointer in the parametrized async mode, closed (daemon stopped) afterwards."""
    made = []

    def make(**kwargs):
        made.append(Checkpointer(tmp_path, request.param, 0, 1, **kwargs))
        return made[-1]

    yield make
    for ck in made:
        ck.close()


def saved_weights(path):
    fresh = Transformer(CFG)
    load_checkpoint(path, fresh, None, restore_rng_state=False)
    return fresh.state_dict()


def bump(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


@pytest.mark.parametrize("checkpointer", ASYNC_MODES, indirect=True)
def test_async_save_commits_only_in_wait(tmp_path, checkpointer):
    model, opt = setup()
    commits = []
    ck = checkpointer(on_commit=lambda s, p: commits.append(s))
    ck.save(1, model, opt, {"step": 1})
    assert ck.in_flight == 1
    assert not step_dir(tmp_path, 1).exists() and not (tmp_path / "latest").exists()
    assert ck.wait() == step_dir(tmp_path, 1)
    assert commits == [1] and os.readlink(tmp_path / "latest") == "step_1"
    assert ck.in_flight is None and ck.wait() is None


@pytest.mark.parametrize("checkpointer", ASYNC_MODES, indirect=True)
def test_next_save_waits_for_the_previous_one(tmp_path, checkpointer):
    model, opt = setup()
    ck = checkpointer()
    ck.save(1, model, opt, {"step": 1})
    ck.save(2, model, opt, {"step": 2})
    assert step_dir(tmp_path, 1).is_dir()  # committed by the second save
    assert ck.in_flight == 2
    ck.wait()
    assert os.readlink(tmp_path / "latest") == "step_2"


@pytest.mark.parametrize("checkpointer", ASYNC_MODES, indirect=True)
def test_async_save_holds_the_state_at_save_time(tmp_path, checkpointer):
    """The loop mutates the weights right after save() returns; the checkpoint must not see it,
    nor the next save, which reuses the staging buffers."""
    model, opt = setup()
    ck = checkpointer()
    expected = []
    for step in (1, 2):
        expected.append({k: v.clone() for k, v in model.state_dict().items()})
        ck.save(step, model, opt, {"step": step})
        bump(model)
    ck.wait()
    for step, weights in zip((1, 2), expected, strict=True):
        got = saved_weights(step_dir(tmp_path, step))
        assert all(torch.equal(got[k], v) for k, v in weights.items()), step


def test_process_mode_leaves_no_process_group_or_daemon_behind(tmp_path):
    from torch.distributed.checkpoint import _async_process_executor

    model, opt = setup()
    ck = Checkpointer(tmp_path, AsyncMode.ASYNC_PROCESS, 0, 1)
    ck.save(1, model, opt, {"step": 1})
    ck.wait()  # torch starts its daemon in the background, during the first save
    ck.save(2, model, opt, {"step": 2})
    daemon = _async_process_executor._CHECKPOINT_PROCESS
    assert daemon is not None and daemon._save_process.is_alive()
    ck.close()
    assert not daemon._save_process.is_alive()
    assert not torch.distributed.is_initialized()
    assert os.readlink(tmp_path / "latest") == "step_2"  # close() committed the save in flight


def test_sync_save_commits_at_once(tmp_path):
    model, opt = setup()
    ck = Checkpointer(tmp_path, AsyncMode.DISABLED, 0, 1)
    ck.save(3, model, opt, {"step": 3})
    assert ck.in_flight is None and step_dir(tmp_path, 3).is_dir()
