"""The text step with a mixture-of-experts model: the auxiliary losses reach the objective,
their statistics come back in the result, a non-finite one skips the update, and the
balancing bias moves after an applied step only."""

from __future__ import annotations

import contextlib
import copy
import math
from unittest import mock

import pytest
import torch

from forge.checkpoint.slots import Slots
from forge.config import ModelConfig, OptimizerConfig, Precision, SchedulerConfig
from forge.config.sections import MoeRouter
from forge.data.batch import Batch
from forge.model.chunked_loss import LossSpec
from forge.model.moe import AUX, MoE
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, resolve_schedule
from forge.resilience.faults import parse_faults, with_faults
from forge.training.steps.common import StepTotals, finish_step, micro_batch_loss
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step
from forge.types import LoopState, ReplayVerdict

CFG = ModelConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    max_seq_len=16,
    moe_num_experts=4,
    moe_top_k=2,
    moe_router=MoeRouter.SIGMOID,
    moe_bias_update_rate=0.05,
)
SPEC = LossSpec(moe_aux_weight=0.5, moe_z_weight=0.1)


def batch(seed: int, rows: int = 4) -> Batch:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 259, (rows, 17), generator=g)
    return Batch(inputs=t[:, :-1], labels=t[:, 1:])


NO_SCHEDULE = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)


def param_module(param: torch.nn.Parameter) -> torch.nn.Module:
    """A module holding just ``param``."""
    module = torch.nn.Module()
    module.param = param
    return module


def setup():
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    sched = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)
    step = make_text_step(
        StepSpec(model, opt, sched, 1e-2, Precision.FP32, loss=SPEC, bias_rate=0.05)
    )
    return model, opt, step


def biases(model: Transformer) -> list[torch.Tensor]:
    return [m.router.expert_bias.clone() for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("chunk", [0, 8], ids=["plain loss", "chunked loss"])
def test_the_objective_adds_the_weighted_sums_of_the_auxiliary_losses(chunk):
    torch.manual_seed(0)
    model = Transformer(CFG)
    spec = LossSpec(chunk, moe_aux_weight=0.5, moe_z_weight=0.1)
    terms = micro_batch_loss(model, batch(1), contextlib.nullcontext, loss_spec=spec)
    assert terms.moe is not None and terms.moe.shape == (2, 8)
    extra = 0.5 * terms.moe[:, AUX].sum() + 0.1 * terms.moe[:, AUX + 1].sum()
    torch.testing.assert_close(terms.objective.detach(), terms.loss + extra)


def test_the_step_reports_the_statistics_and_moves_the_bias_after_the_update():
    model, _, step = setup()
    before = biases(model)
    result = step((batch(1), batch(2)), LoopState())
    assert result.moe is not None and result.finite
    assert result.moe.assigned == 2 * 64 * 2 * 2  # 2 micro-batches x 64 tokens x top-2 x 2 layers
    assert [sum(layer) for layer in result.moe.loads] == [256.0, 256.0]
    assert 0.9 < result.moe.aux_loss < 2.0  # E x sum f P: 1 when balanced
    for b0, b1, layer in zip(before, biases(model), result.moe.loads, strict=True):
        loads = torch.tensor(layer)
        expected = b0 + 0.05 * torch.sign(loads.mean() - loads)
        torch.testing.assert_close(b1, expected)


def test_a_non_finite_step_moves_neither_weights_nor_bias():
    model, opt, step = setup()
    step((batch(1),), LoopState())  # some optimizer state and a moved bias
    weights, state, bias = (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.state_dict()),
        biases(model),
    )
    with torch.no_grad():  # a NaN router: its losses (and everything after it) are not finite
        model.layers["0"].feed_forward.router.gate.weight[0, 0] = float("nan")  # type: ignore[index]
    weights["layers.0.feed_forward.router.gate.weight"][0, 0] = float("nan")
    result = step((batch(2),), LoopState(step=1))
    assert not result.finite and result.moe is not None
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], equal_nan=True, msg=name)
    assert [torch.equal(a, b) for a, b in zip(bias, biases(model), strict=True)] == [True, True]
    assert opt.state_dict()["state"][0]["step"] == state["state"][0]["step"]


def test_a_non_finite_auxiliary_loss_alone_skips_the_update():
    """Loss and gradients finite, the balancing loss not: the step is still skipped."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(3)
    called = []
    stats = torch.tensor([[float("nan"), 0.5, 0.0, 8.0, 4.0, 4.0]])  # aux, z, dropped, assigned
    spec = StepSpec(param_module(param), opt, NO_SCHEDULE, 0.1, bias_rate=0.05)
    totals = StepTotals(torch.tensor(2.0), torch.tensor(1.0), [param], tokens=8, moe=stats)
    with mock.patch("forge.training.steps.common.balance_experts", lambda *a: called.append(True)):
        result = finish_step(spec, totals, 1, lr=0.1)
    assert not result.finite and result.moe is not None and result.moe.loads == ((4.0, 4.0),)
    assert torch.equal(param.detach(), torch.ones(3)) and called == []


def test_a_rollback_snapshot_restores_the_balancing_bias():
    """``resilience.on_nonfinite = "rollback"`` returns the bias with the weights."""
    model, opt, step = setup()
    step((batch(1),), LoopState())
    slots = Slots(model, opt)
    slots.push("rollback")
    saved = biases(model)
    step((batch(2),), LoopState(step=1))
    assert not all(torch.equal(a, b) for a, b in zip(saved, biases(model), strict=True))
    slots.load("rollback")
    assert all(torch.equal(a, b) for a, b in zip(saved, biases(model), strict=True))


@pytest.mark.parametrize("chunk", [0, 8], ids=["plain loss", "chunked loss"])
def test_an_injected_nan_skips_the_step_and_leaves_the_routing_statistics(chunk):
    """``FORGE_FAULTS=nan`` on a MoE model: the outputs (and so loss and gradients) are NaN,
    the router's statistics stay as measured, nothing moves; the next step trains."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    spec = StepSpec(model, opt, NO_SCHEDULE, 1e-2, loss=LossSpec(chunk), bias_rate=0.05)
    step = with_faults(make_text_step(spec), model, parse_faults("nan:step=1"), rank=0)
    weights = copy.deepcopy(model.state_dict())
    result = step((batch(1), batch(2)), LoopState())
    assert math.isnan(result.loss) and math.isnan(result.grad_norm) and not result.finite
    assert result.moe is not None and result.moe.finite and result.moe.assigned > 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    assert step((batch(3),), LoopState(step=1)).finite


@pytest.mark.parametrize("capacity", [0.0, 1.0], ids=["dropless", "capacity 1.0"])
def test_a_step_is_the_same_whichever_expert_kernel_runs(capacity):
    """Grouped GEMM as a CPU runs it, with groups padded to 8 rows as a GPU runs it, the
    sync-free fixed-capacity buffers and the per-expert loop: one step, the same loss, grad
    norm, statistics and weights."""
    import attrs

    from forge.model import moe as moe_module
    from forge.model.expert_groups import ExpertKernel

    runs = []
    modes = [(ExpertKernel.GROUPED, 1), (ExpertKernel.GROUPED, 8), (ExpertKernel.BUFFERED, 1)]
    for kernel, align in [*modes, (ExpertKernel.LOOP, 1)]:
        cfg = attrs.evolve(CFG, moe_capacity_factor=capacity)
        torch.manual_seed(0)
        model = Transformer(cfg)
        opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
        step = make_text_step(StepSpec(model, opt, NO_SCHEDULE, 1e-2, loss=SPEC, bias_rate=0.05))
        with (
            mock.patch.object(moe_module, "expert_kernel", lambda *_, k=kernel: k),
            mock.patch.object(moe_module, "group_alignment", lambda *_, a=align: a),
        ):
            result = step((batch(1), batch(2)), LoopState())
        runs.append((result, model.state_dict()))
    (want, weights), others = runs[-1], runs[:-1]
    for result, state in others:
        assert result.loss == pytest.approx(want.loss, rel=1e-6)
        assert result.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
        assert result.moe == want.moe
        for name, tensor in state.items():
            torch.testing.assert_close(tensor, weights[name], atol=1e-6, rtol=1e-5, msg=name)


def test_a_replayed_moe_step_moves_the_bias_once_and_equals_one_computed_once():
    """Every step computed twice (``replay_interval = 1``): the aux-loss-free bias moves once
    per step, and loss, statistics, weights and biases equal the unreplayed run's."""
    from forge.training.loop.plan import ReplayRule

    runs = []
    for rule in (ReplayRule(), ReplayRule(interval=1)):
        torch.manual_seed(0)
        model = Transformer(CFG)
        opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
        spec = StepSpec(model, opt, NO_SCHEDULE, 1e-2, loss=SPEC, bias_rate=0.05, replay=rule)
        step = make_text_step(spec)
        results = [step((batch(k), batch(k + 5)), LoopState(step=k)) for k in range(3)]
        runs.append((results, model.state_dict(), biases(model)))
    (once, w1, b1), (twice, w2, b2) = runs
    assert [r.replay for r in twice] == [ReplayVerdict()] * 3
    assert [(r.loss, r.moe) for r in once] == [(r.loss, r.moe) for r in twice]
    assert all(torch.equal(a, b) for a, b in zip(b1, b2, strict=True))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
