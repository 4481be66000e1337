"""The dynamic optimizer under a freeze schedule: which parameters it holds at each stage,
their weight-decay split, fresh state for newcomers, no gradient for frozen parameters."""

from __future__ import annotations

import pytest
import torch

from forge.config import ModelConfig, OptimizerConfig, Precision, SchedulerConfig
from forge.config.freeze import FreezeRule
from forge.data.batch import Batch
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, resolve_schedule
from forge.optim.freezing import Freezer, freeze_for_step, named_parameters
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step
from forge.types import LoopState

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)
# the head and final norm for 2 steps, then the blocks too, from step 5 everything
RULES = (
    FreezeRule("tok_embeddings", until_step=4),
    FreezeRule("layers", until_step=2),
)
OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1)


def batch(seed: int) -> Batch:
    t = torch.randint(0, 259, (4, 17), generator=torch.Generator().manual_seed(seed))
    return Batch(inputs=t[:, :-1], labels=t[:, 1:])


def build():
    torch.manual_seed(0)
    model = Transformer(CFG)
    freeze_for_step(model, RULES, 1)
    optimizer = build_optimizer(model, OPT)
    return model, optimizer, Freezer(model, optimizer, RULES, OPT)


def in_optimizer(model, optimizer) -> set[str]:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return {n for n, p in named_parameters(model).items() if id(p) in ids}


def decay_of(optimizer) -> dict[int, float]:
    return {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize(
    ("step", "holds"),
    [
        (1, {"norm.weight", "output.weight"}),
        (2, {"norm.weight", "output.weight"}),
        (3, {"norm.weight", "output.weight", "layers.*"}),
        (4, {"norm.weight", "output.weight", "layers.*"}),
        (5, {"norm.weight", "output.weight", "layers.*", "tok_embeddings.weight"}),
    ],
)
def test_the_optimizer_holds_each_stages_parameters(step, holds):
    model, optimizer, freezer = build()
    for s in range(1, step + 1):
        freezer.apply(s)
    names = in_optimizer(model, optimizer)
    expected = {
        n
        for n in named_parameters(model)
        if n in holds or ("layers.*" in holds and n.startswith("layers."))
    }
    assert names == expected
    assert all(p.requires_grad is (n in expected) for n, p in named_parameters(model).items())
    # matrices decay, norms do not, the embedding neither (decay_embeddings is off)
    decay = decay_of(optimizer)
    for n, p in named_parameters(model).items():
        if n in expected:
            wants = 0.1 if p.ndim >= 2 and "embeddings" not in n else 0.0
            assert decay[id(p)] == wants, n


def test_frozen_parameters_get_no_gradient_and_no_state_and_newcomers_start_fresh():
    model, optimizer, freezer = build()
    sched = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)
    step = make_text_step(StepSpec(model, optimizer, sched, 1e-2, Precision.FP32))
    block = named_parameters(model)["layers.0.attention.wq.weight"]
    before = block.detach().clone()
    for s in range(2):
        freezer.apply(s + 1)
        step((batch(s),), LoopState(step=s))
    assert block.grad is None and block not in optimizer.state  # frozen: nothing at all
    assert torch.equal(block.detach(), before)
    transition = freezer.apply(3)
    assert transition is not None and transition.step == 3
    assert transition.frozen == CFG.vocab_size * CFG.dim  # only the embedding still frozen
    step((batch(2),), LoopState(step=2))
    assert not torch.equal(block.detach(), before)
    head = named_parameters(model)["output.weight"]
    assert int(optimizer.state[block]["step"]) == 1  # fresh state, one update old
    assert int(optimizer.state[head]["step"]) == 3


def test_a_set_that_is_not_a_superset_rebuilds_the_groups():
    """Going back to an older checkpoint's stage (a resume falling back, a rollback)."""
    model, optimizer, freezer = build()
    freezer.apply(5)
    assert len(in_optimizer(model, optimizer)) == len(named_parameters(model))
    freezer.hold(freezer.trainable_at(1), 1)  # as a resume or a rollback does
    assert in_optimizer(model, optimizer) == {"norm.weight", "output.weight"}
    assert not named_parameters(model)["layers.0.attention.wq.weight"].requires_grad
