"""Slots: exact snapshots that never alias the live model or optimizer."""

import torch

from forge.checkpoint.slots import Slots
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
