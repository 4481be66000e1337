"""A replayed step in one process: the digest sees any changed gradient bit, a step computed
twice equals one computed once, a corrupted computation is outvoted, three disagreeing ones
leave the weights alone, and a spike dropped by the step never touches the optimizer."""

from __future__ import annotations

import sys

import pytest
import torch

from forge.config import ModelConfig, OptimizerConfig, Precision, SchedulerConfig
from forge.config.sections import SpikePolicy
from forge.data.batch import Batch
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, resolve_schedule
from forge.resilience.faults import flip_bit, gradient_faults, parse_faults
from forge.resilience.reports import FaultReport
from forge.training.loop.plan import ReplayRule, observed
from forge.training.steps.replay import tensor_digest, unverifiable_operations
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step, text_computation
from forge.types import LoopState, LossStats, PendingStep, ReplayVerdict, StepResult

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def setup(rule=None, faults="", **spec):
    rule = rule or ReplayRule()
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    sched = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)
    fault = gradient_faults(parse_faults(faults), rank=0)
    step = make_text_step(
        StepSpec(model, opt, sched, 1e-2, Precision.FP32, replay=rule, fault=fault, **spec)
    )
    return model, step


def batch(seed, rows=4):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 259, (rows, 17), generator=g)
    return Batch(inputs=t[:, :-1], labels=t[:, 1:])


def run(step, steps=3):
    """Losses of ``steps`` steps, and each step's replay verdict."""
    state, out = LoopState(), []
    for k in range(steps):
        r = step((batch(k), batch(k + 10)), state)
        out.append((r.loss, r.replay))
        state = LoopState(step=k + 1)
    return out


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("element", [0, 7, 63])
def test_the_digest_sees_one_flipped_bit_anywhere(dtype, element):
    t = torch.randn(64).to(dtype)
    before = tensor_digest(t)
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    t.view(width)[element] ^= 1
    assert not torch.equal(tensor_digest(t), before)


def test_the_digest_sees_the_same_change_in_another_place():
    a, b = torch.zeros(8), torch.zeros(8)
    a.view(torch.int32)[1] ^= 1 << 22
    b.view(torch.int32)[2] ^= 1 << 22
    assert not torch.equal(tensor_digest(a), tensor_digest(b))


def test_flip_bit_changes_one_non_zero_element_and_keeps_it_finite():
    p = torch.nn.Parameter(torch.zeros(2, 4))
    p.grad = torch.tensor([[0.0, 1.0, 2.0, 0.0], [3.0, 4.0, 0.0, 5.0]])
    before = p.grad.clone()
    few = torch.nn.Parameter(torch.zeros(4))
    few.grad = torch.tensor([0.0, 1.0, 0.0, 2.0])  # two non-zero: not the one
    flip_bit([few, p], element=2)  # the third non-zero element: 3.0
    changed = (p.grad != before).flatten().nonzero().flatten().tolist()
    assert changed == [4] and torch.isfinite(p.grad).all()


def test_a_replayed_run_equals_one_computed_once():
    m1, once = setup()
    m2, replayed = setup(ReplayRule(interval=1))
    a, b = run(once), run(replayed)
    assert [loss for loss, _ in a] == [loss for loss, _ in b]
    assert [v for _, v in a] == [None] * 3
    assert [v for _, v in b] == [ReplayVerdict()] * 3
    for p1, p2 in zip(weights(m1), weights(m2), strict=True):
        assert torch.equal(p1, p2)


class Noisy(torch.nn.Module):
    """A model that draws from the RNG in every forward (as dropout would): its logits are
    scaled by ``1 + rand / 100``."""

    def __init__(self, inner: Transformer) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens, **kwargs):
        return self.inner(tokens, **kwargs) * (1 + torch.rand(()) / 100)


def noisy_setup(rule):
    torch.manual_seed(0)
    model = Noisy(Transformer(CFG))
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    sched = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)
    return model, make_text_step(StepSpec(model, opt, sched, 1e-2, replay=rule))


def test_a_model_that_draws_random_numbers_replays_alike_and_leaves_the_streams_as_once():
    """Each computation starts from the same RNG state (else the draws, and so the
    gradients, would differ and every replay would fail), and the streams end where one
    computation leaves them."""
    m1, once = noisy_setup(ReplayRule())
    m2, replayed = noisy_setup(ReplayRule(interval=1))
    torch.manual_seed(5)
    a = run(once)
    after_once = torch.rand(3)
    torch.manual_seed(5)
    b = run(replayed)
    assert [v for _, v in b] == [ReplayVerdict()] * 3
    assert [loss for loss, _ in a] == [loss for loss, _ in b]
    assert torch.equal(torch.rand(3), after_once)
    for p1, p2 in zip(weights(m1), weights(m2), strict=True):
        assert torch.equal(p1, p2)


def test_the_digest_is_the_same_chunk_by_chunk(monkeypatch):
    from forge.training.steps import replay

    t = torch.randn(1000)
    whole = tensor_digest(t)
    monkeypatch.setattr(replay, "DIGEST_CHUNK", 7)
    assert torch.equal(tensor_digest(t), whole)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_flip_bit_takes_every_gradient_dtype(dtype):
    p = torch.nn.Parameter(torch.ones(8, dtype=dtype))
    p.grad = torch.ones(8, dtype=dtype)
    flip_bit([p], element=3)
    assert p.grad[3] == 1.5 and (p.grad != 1).sum() == 1


def test_a_corrupted_computation_is_outvoted_and_the_run_goes_on_as_if_it_had_not_been():
    m1, clean = setup(ReplayRule(interval=1))
    m2, faulty = setup(ReplayRule(interval=1), "corrupt:step=2")
    a, b = run(clean), run(faulty)
    assert [loss for loss, _ in a] == [loss for loss, _ in b]
    assert [v for _, v in b] == [ReplayVerdict(), ReplayVerdict(mismatched=(0,)), ReplayVerdict()]
    for p1, p2 in zip(weights(m1), weights(m2), strict=True):
        assert torch.equal(p1, p2)


def test_three_disagreeing_computations_leave_the_weights_alone():
    model, step = setup(ReplayRule(interval=1), "corrupt:step=1:times=3")
    before = weights(model)
    result = step((batch(0),), LoopState())
    assert result.replay == ReplayVerdict(mismatched=(0,), inconsistent=(0,))
    assert all(torch.equal(p, q) for p, q in zip(before, weights(model), strict=True))


def test_without_replay_a_corruption_goes_unseen_and_is_trained_on():
    m1, clean = setup()
    m2, faulty = setup(faults="corrupt:step=2")
    a, b = run(clean, steps=2), run(faulty, steps=2)
    assert a == b  # nothing tells them apart...
    assert not all(torch.equal(p, q) for p, q in zip(weights(m1), weights(m2), strict=True))


def test_the_first_step_of_a_launch_is_replayed_and_then_only_the_interval():
    _, step = setup(ReplayRule(interval=0, first_step=True))
    assert [v for _, v in run(step)] == [ReplayVerdict(), None, None]


def test_a_spike_dropped_by_the_step_never_touches_the_weights():
    model, step = setup(faults="spike:step=1:scale=1000", spike_threshold=6.0, drops_spike=True)
    stats = LossStats()
    for loss in [5.6] * 10:
        stats = observed(stats, loss)
    before = weights(model)
    result = step((batch(0),), LoopState(loss_stats=stats))
    assert result.spike and result.world_loss == result.loss > 1000
    assert all(torch.equal(p, q) for p, q in zip(before, weights(model), strict=True))


def test_a_spike_under_warn_is_trained_on():
    model, step = setup(faults="spike:step=1:scale=1000", spike_threshold=6.0)
    stats = LossStats()
    for loss in [5.6] * 10:
        stats = observed(stats, loss)
    before = weights(model)
    assert step((batch(0),), LoopState(loss_stats=stats)).spike
    assert not all(torch.equal(p, q) for p, q in zip(before, weights(model), strict=True))


def test_an_operation_without_a_deterministic_kernel_turns_replays_off_with_one_warning(
    monkeypatch, capsys
):
    """Where torch warns that an operation has no deterministic kernel (CUDA), two
    computations may differ on healthy hardware: no verdict, one warning naming it, and no
    more replays this launch (never an exit 6 on noise)."""
    import contextlib

    from forge.training.steps import replay

    @contextlib.contextmanager
    def noisy_kernels(device):
        yield ["index_add_cuda_"]

    monkeypatch.setattr(replay, "deterministic_kernels", noisy_kernels)
    _, step = setup(ReplayRule(interval=1))
    uncompared = ReplayVerdict(compared=False, unverifiable=("index_add_cuda_",))
    verdicts = [v for _, v in run(step)]
    assert verdicts == [uncompared, None, None] and not uncompared.failed
    report = FaultReport(True, ("h",), SpikePolicy.WARN, sys.stderr)
    for k, verdict in enumerate(verdicts, start=1):
        report.on_before_optimizer_step(
            PendingStep(k, StepResult(1.0, 1.0, 1, 0.1, replay=verdict)), None, None
        )  # type: ignore[arg-type]
    lines = [x for x in capsys.readouterr().err.splitlines() if "could not be replayed" in x]
    assert len(lines) == 1 and "step 1" in lines[0] and "index_add_cuda_" in lines[0]


def put_step(tokens, **kwargs):
    """``put_``: an operation torch names as having no deterministic kernel on any device."""
    torch.zeros(2).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("extra,named", [(None, ()), (put_step, ("put_",))])
def test_the_kernel_probe_names_what_torch_names_and_leaves_no_trace(extra, named):
    """One computation under torch's deterministic mode: the operations it warns of, by
    name; afterwards no gradient, the RNG streams where they were (the model draws from
    them) and torch's own settings as before."""
    model, _ = noisy_setup(ReplayRule())
    inner = model.forward

    def forward(tokens, **kwargs):
        if extra is not None:
            extra(tokens)
        return inner(tokens, **kwargs)

    model.forward = forward  # type: ignore[method-assign]
    spec = StepSpec(model, build_optimizer(model, OptimizerConfig(lr=1e-2)), None, 1e-2)  # type: ignore[arg-type]
    compute = text_computation(spec)((batch(0), batch(1)), 1)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    reset = lambda: spec.optimizer.zero_grad(set_to_none=True)  # noqa: E731
    assert unverifiable_operations(compute, reset, torch.device("cpu")) == named
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.rand(3), expected)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize(
    "message,named",
    [
        ("put_ does not have a deterministic implementation, but you set 'torch.use_determ...", "put_"),
        ("Memory Efficient attention defaults to a non-deterministic algorithm. To explicitly enable determinism call ...", "Memory Efficient attention"),
        ("a warning of something else", None),
    ],
)  # fmt: skip
def test_torch_s_words_for_an_operation_without_a_deterministic_kernel(message, named):
    from forge.training.steps.replay import nondeterministic_operation

    assert nondeterministic_operation(message) == named
