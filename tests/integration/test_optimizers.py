"""Lion and Muon(+AdamW): the update rules, the parameter split, and AdamW parity."""

from __future__ import annotations

import pytest
import torch

from forge.config import ModelConfig, OptimizerConfig
from forge.config.optim import OptimizerName
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, param_groups
from forge.optim.optimizers import (
    Lion,
    MuonAdamW,
    ScheduleFreeAdamW,
    evaluation_weights,
    muon_lr_scale,
    newton_schulz,
)

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)


@pytest.mark.parametrize("shape", [(16, 16), (8, 32), (32, 8)])
def test_newton_schulz_makes_singular_values_near_one(shape):
    g = torch.Generator().manual_seed(0)
    m = torch.randn(shape, generator=g) * torch.logspace(-1, 0, shape[1])  # condition ~10
    s = torch.linalg.svdvals(newton_schulz(m, steps=5))
    assert float(s.min()) > 0.5 and float(s.max()) < 1.5
    assert newton_schulz(m, 5).shape == m.shape


def test_lion_takes_the_sign_of_the_interpolated_momentum():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    opt.state[p]["exp_avg"] = torch.tensor([1.0, 1.0, -1.0])
    p.grad = torch.tensor([-20.0, 0.5, 0.5])
    opt.step()
    # direction = sign(0.9 m + 0.1 g) = sign([-1.1, 0.95, -0.85]); decay (1 - 0.1 * 0.5)
    expected = torch.tensor([1.0, -2.0, 3.0]) * 0.95 - 0.1 * torch.tensor([-1.0, 1.0, -1.0])
    torch.testing.assert_close(p.detach(), expected)
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.tensor([0.79, 0.995, -0.985]))


def muon_split(model):
    groups = param_groups(model, OptimizerConfig(name=OptimizerName.MUON))
    return {name: g.get("use_muon", False) for g in groups for name in g["names"]}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    split = muon_split(Transformer(CFG))
    on_muon = {n for n, m in split.items() if m}
    assert on_muon == {
        f"layers.{i}.{w}.weight"
        for i in range(2)
        for w in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    }  # fmt: skip
    assert not split["tok_embeddings.weight"] and not split["output.weight"]
    assert not split["norm.weight"]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_adamw_part_of_muon_equals_torch_adamw(weight_decay):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(5, 3, generator=g)
    grads = [torch.randn(5, 3, generator=g) for _ in range(4)]
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = MuonAdamW([{"params": [a], "weight_decay": weight_decay}], lr=1e-2)
    theirs = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=weight_decay)
    for grad in grads:
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_muon_step_moves_a_matrix_by_lr_times_its_scale_in_rms():
    p = torch.nn.Parameter(torch.zeros(64, 16))
    opt = MuonAdamW([{"params": [p], "use_muon": True}], lr=0.01, momentum=0.0)
    p.grad = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    opt.step()
    rms = float(p.detach().pow(2).mean().sqrt())
    # orthogonal 64x16: RMS 1/sqrt(64) (S' near 1); Moonshot scale 0.2 sqrt(64)
    assert rms == pytest.approx(0.01 * muon_lr_scale(p.shape) / 8, rel=0.35)


@pytest.mark.parametrize("name", list(OptimizerName))
def test_every_optimizer_builds_from_config(name):
    opt = build_optimizer(Transformer(CFG), OptimizerConfig(name=name))
    assert isinstance(opt, torch.optim.Optimizer)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(
        list(Transformer(CFG).parameters())
    )


def trained_schedule_free(steps: int = 4):
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = build_optimizer(model, OptimizerConfig(name=OptimizerName.SCHEDULE_FREE_ADAMW, lr=1e-2))
    assert isinstance(opt, ScheduleFreeAdamW)
    x = torch.randint(0, 259, (2, 16))
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
    return model, opt


def test_schedule_free_evaluation_weights_are_the_averaged_iterate_and_restore_exactly():
    model, opt = trained_schedule_free()
    y = {n: p.detach().clone() for n, p in model.named_parameters()}
    beta1 = opt.param_groups[0]["betas"][0]
    with evaluation_weights(opt):
        for name, p in model.named_parameters():
            z = opt.state[p]["z"]
            x = y[name] + (1 - 1 / beta1) * (z - y[name])  # x = y + (1 - 1/b1)(z - y)
            torch.testing.assert_close(p.detach(), x, rtol=0, atol=1e-6)
        assert any(not torch.equal(p, y[n]) for n, p in model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, y[name]), name  # bit for bit: a run that evaluates resumes exactly


def test_schedule_free_first_step_puts_y_x_and_z_on_the_adam_step():
    """Step 1 gives the newest iterate all the average's weight: y = x = z = start - lr·g/|g|."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = ScheduleFreeAdamW([p], lr=0.1, betas=(0.9, 0.999))
    p.grad = torch.tensor([1.0, -1.0, 2.0])
    opt.step()
    expected = torch.ones(3) - 0.1 * torch.sign(p.grad)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["z"], expected, rtol=0, atol=1e-6)
    with evaluation_weights(opt):
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
