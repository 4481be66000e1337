"""Slots: exact snapshots that never alias the live model or optimizer."""

import attrs
import pytest
import torch

from forge.checkpoint.checkpointer import save_checkpoint
from forge.checkpoint.slots import Slots
from forge.checkpoint.store import CheckpointError, step_dir
from forge.config import ModelConfig, OptimizerConfig
from forge.model.transformer import Transformer
from forge.optim import build_optimizer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randint(0, 259, (2, 16), generator=g)).float().mean().backward()
    opt.step()
    opt.zero_grad()


def state(model, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()},
    )


def same(a, b):
    (ma, oa), (mb, ob) = a, b
    return (
        all(torch.equal(ma[k], mb[k]) for k in ma)
        and oa.keys() == ob.keys()
        and all(torch.equal(oa[k][n], ob[k][n]) for k in oa for n in oa[k])
    )


def setup():
    torch.manual_seed(0)
    model = Transformer(CFG)
    return model, build_optimizer(model, OptimizerConfig(lr=1e-2))


def test_load_restores_model_and_optimizer_exactly():
    model, opt = setup()
    step(model, opt, 1)
    slots = Slots(model, opt)
    slots.push("a")
    before = state(model, opt)
    step(model, opt, 2)
    step(model, opt, 3)
    assert not same(before, state(model, opt))
    slots.load("a")
    assert same(before, state(model, opt))


def test_a_restored_run_continues_like_the_original():
    model, opt = setup()
    step(model, opt, 1)
    slots = Slots(model, opt)
    slots.push("a")
    step(model, opt, 2)
    expected = state(model, opt)
    step(model, opt, 9)
    slots.load("a")
    step(model, opt, 2)  # training after a load must not write into the slot either
    assert same(expected, state(model, opt))
    slots.load("a")
    step(model, opt, 2)
    assert same(expected, state(model, opt))


def test_snapshot_before_the_first_step_empties_the_optimizer():
    model, opt = setup()
    slots = Slots(model, opt)
    slots.push("start")
    step(model, opt, 1)
    slots.load("start")
    assert opt.state_dict()["state"] == {}


def test_pop_forgets():
    model, opt = setup()
    slots = Slots(model, opt)
    slots.push("x")
    assert "x" in slots
    slots.pop("x")
    assert "x" not in slots


def test_prefetch_reads_a_checkpoint_while_training_continues(tmp_path):
    """The prefetched slot restores the saved step exactly, and training goes on as it did."""
    model, opt = setup()
    step(model, opt, 1)
    save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    saved = state(model, opt)
    step(model, opt, 2)
    expected_next = state(model, opt)
    slots = Slots(model, opt)
    pending = slots.prefetch("disk", step_dir(tmp_path, 1))
    step(model, opt, 7)  # the loop keeps going while the reader works
    step(model, opt, 8)
    assert "disk" in slots
    slots.load("disk")
    assert pending.done()
    assert same(saved, state(model, opt))
    step(model, opt, 2)
    assert same(expected_next, state(model, opt))
    slots.load("disk")  # a slot can be loaded again: the step did not write into it
    assert same(saved, state(model, opt))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda path: (path / ".metadata").unlink(), "not a complete checkpoint"),
        (None, "has shape"),
    ],
)
def test_prefetch_refuses_an_unloadable_checkpoint_at_once(tmp_path, damage, message):
    model, opt = setup()
    step(model, opt, 1)
    path = save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    if damage is not None:
        damage(path)
    else:  # a model of another width
        torch.manual_seed(0)
        model = Transformer(attrs.evolve(CFG, dim=64))
        opt = build_optimizer(model, OptimizerConfig())
    with pytest.raises(CheckpointError, match=message):
        Slots(model, opt).prefetch("disk", path)
