"""text_step: accumulation, clipping, and a non-finite step that never touches the optimizer."""

import contextlib
import copy

import attrs
import pytest
import torch

from forge.config import ModelConfig, OptimizerConfig, Precision, SchedulerConfig
from forge.data.batch import Batch
from forge.data.packing import IGNORE_INDEX
from forge.model.chunked_loss import LossSpec
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, param_groups, resolve_schedule
from forge.training.steps.common import micro_batch_loss
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step
from forge.types import LoopState

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def setup(clip=None, sgd=False, cfg=CFG, loss=None):
    torch.manual_seed(0)
    model = Transformer(cfg)
    if sgd:  # the update is the gradient itself: compares gradients, not Adam's normalised steps
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    else:
        opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    sched = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)
    spec = StepSpec(model, opt, sched, 1e-2, Precision.FP32, clip)
    if loss is not None:
        spec = attrs.evolve(spec, loss=loss)
    return model, opt, make_text_step(spec)


def batch(seed, rows=4):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 259, (rows, 17), generator=g)
    return Batch(inputs=t[:, :-1], labels=t[:, 1:])


def test_accumulation_equals_one_big_batch():
    m1, _, step1 = setup(sgd=True)
    m2, _, step2 = setup(sgd=True)
    a, b = batch(1), batch(2)
    big = Batch(torch.cat([a.inputs, b.inputs]), torch.cat([a.labels, b.labels]))
    r1 = step1((a, b), LoopState())
    r2 = step2((big,), LoopState())
    assert r1.loss == pytest.approx(r2.loss, rel=1e-5)
    assert r1.tokens == r2.tokens == 128
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-6)


def test_clipping_bounds_the_update_and_reports_the_raw_norm():
    _, _, step = setup(clip=1e-3)
    r = step((batch(1),), LoopState())
    assert r.grad_norm > 1e-3


def test_non_finite_step_leaves_weights_and_optimizer_untouched():
    model, opt, step = setup()
    step((batch(1),), LoopState())  # populate optimizer state
    before_params = copy.deepcopy(model.state_dict())
    before_opt = copy.deepcopy(opt.state_dict())
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    nan_weight = model.norm.weight.detach().clone()  # NaN != NaN: compare where the NaNs are
    r = step((batch(2),), LoopState(step=1))
    assert not r.finite
    assert torch.equal(model.norm.weight.isnan(), nan_weight.isnan())
    for name, p in model.state_dict().items():
        if name != "norm.weight":
            assert torch.equal(p, before_params[name]), name
    after = opt.state_dict()
    for k, s in before_opt["state"].items():
        assert after["state"][k]["step"] == s["step"]
        assert torch.equal(after["state"][k]["exp_avg"], s["exp_avg"])
    assert all(p.grad is None for p in model.parameters())


def test_lr_follows_the_schedule_step():
    _, opt, step = setup()
    r = step((batch(1),), LoopState(step=50))
    assert r.lr == opt.param_groups[0]["lr"] < 1e-2


def test_norms_and_embeddings_do_not_decay():
    groups = param_groups(Transformer(CFG), OptimizerConfig(weight_decay=0.1))
    decay = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    no_decay = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    assert "tok_embeddings.weight" in no_decay and "norm.weight" in no_decay
    assert "layers.0.attention.wq.weight" in decay and "output.weight" in decay
    with_emb = param_groups(Transformer(CFG), OptimizerConfig(decay_embeddings=True))
    assert "tok_embeddings.weight" in with_emb[0]["names"]


# what reads a tensor's value on the host: on a GPU each is a device synchronisation
HOST_READS = ("cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__")


def count_host_reads(monkeypatch, optimizer) -> list[str]:
    """Patch every host read of a tensor; reads inside ``optimizer.step`` (AdamW reads its CPU
    step counters, which are no device sync) are not counted."""
    reads: list[str] = []
    inside_optimizer = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            if not inside_optimizer:
                reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    real_step = optimizer.step

    def step(*args, **kwargs):
        inside_optimizer.append(True)
        try:
            return real_step(*args, **kwargs)
        finally:
            inside_optimizer.pop()

    monkeypatch.setattr(optimizer, "step", step)
    return reads


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_a_step_reads_the_device_once_whatever_the_micro_batches(monkeypatch, clip):
    _, opt, step = setup(clip=clip)
    step((batch(1),), LoopState())  # optimizer state exists: later steps are steady state
    reads = count_host_reads(monkeypatch, opt)
    result = step((batch(1), batch(2), batch(3), batch(4)), LoopState(step=1))
    assert reads == ["tolist"]  # loss and grad norm together, once
    assert result.finite


def masked_batch(seed):
    b = batch(seed)
    labels = b.labels.clone()
    labels[:, :5] = IGNORE_INDEX  # packed rows mask document boundaries like this
    return Batch(b.inputs, labels)


@pytest.mark.parametrize("masked", [False, True])
def test_z_loss_parts_equal_cross_entropy_and_the_mean_squared_logsumexp(masked):
    model, _, _ = setup()
    b = masked_batch(3) if masked else batch(3)
    terms = micro_batch_loss(model, b, contextlib.nullcontext, loss_spec=LossSpec(z_weight=0.5))
    ce, z = terms.loss, terms.z
    logits = model(b.inputs).float()
    keep = b.labels != IGNORE_INDEX
    expected_ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.labels.flatten())
    expected_z = logits.logsumexp(-1)[keep].square().mean()
    torch.testing.assert_close(ce, expected_ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, expected_z, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(terms.objective, ce + 0.5 * z, rtol=1e-6, atol=1e-6)


def test_the_z_loss_is_in_the_objective_but_not_in_the_reported_loss():
    weight = 0.1
    _, _, plain = setup(sgd=True)
    z_model, z_opt, _ = setup(sgd=True)
    sched = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)
    z_step = make_text_step(
        StepSpec(z_model, z_opt, sched, 1e-2, Precision.FP32, loss=LossSpec(z_weight=weight))
    )
    reference = copy.deepcopy(z_model)
    a, b = batch(1), batch(2)
    r_plain, r_z = plain((a, b), LoopState()), z_step((a, b), LoopState())
    assert r_z.loss == pytest.approx(r_plain.loss, rel=1e-6)  # the loss logged is the pure CE
    assert r_plain.z_loss is None and r_z.z_loss is not None and r_z.z_loss > 0
    # SGD: the update is -lr × the gradient of mean over micro-batches of (CE + w z)
    objective = (
        sum(
            micro_batch_loss(
                reference, x, contextlib.nullcontext, loss_spec=LossSpec(z_weight=weight)
            ).objective
            for x in (a, b)
        )
        / 2
    )
    objective.backward()
    for p_ref, p_z in zip(reference.parameters(), z_model.parameters(), strict=True):
        torch.testing.assert_close(
            p_z.detach(), p_ref.detach() - 1e-2 * p_ref.grad, rtol=1e-5, atol=1e-6
        )


def packed_rows(n_rows=8, seed=5):
    """Rows of two or three documents each, labels masked at every boundary and in a
    ragged tail, so that rows hold different numbers of labels (packing's shape)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 259, (n_rows, 17), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    positions = torch.zeros_like(inputs)
    documents = torch.zeros_like(inputs)
    for r in range(n_rows):
        cuts = sorted(torch.randint(1, 15, (2,), generator=g).tolist())
        for d, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, 16], strict=True)):
            documents[r, lo:hi] = d
            positions[r, lo:hi] = torch.arange(hi - lo)
            if hi < 16:
                labels[r, hi - 1] = IGNORE_INDEX  # the label would be the next document's
        labels[r, 16 - r :] = IGNORE_INDEX  # row r ends with r padded positions
    return inputs, labels, positions, documents


def split_rows(rows, micro, packed):
    inputs, labels, positions, documents = rows
    return tuple(
        Batch(
            inputs[i : i + micro],
            labels[i : i + micro],
            positions[i : i + micro] if packed else None,
            documents[i : i + micro] if packed else None,
        )
        for i in range(0, len(inputs), micro)
    )


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("micro,accum", [(8, 1), (2, 4), (1, 8)])
def test_a_step_weighs_every_label_alike_however_the_batch_is_split(packed, micro, accum):
    """The loss and the update of 8 rows do not depend on their split into micro-batches
    (4x2 is the baseline), even when rows hold different numbers of labels."""
    rows = packed_rows()
    m_ref, _, step_ref = setup(sgd=True)
    m, _, step = setup(sgd=True)
    before = [p.detach().clone() for p in m.parameters()]
    ref = step_ref(split_rows(rows, 4, packed), LoopState())
    got = step(split_rows(rows, micro, packed), LoopState())
    assert len(split_rows(rows, micro, packed)) == accum
    assert got.loss == pytest.approx(ref.loss, rel=1e-6)
    assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-6)
    for p0, p_ref, p in zip(before, m_ref.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(p - p0, p_ref - p0, rtol=1e-5, atol=1e-7)


def test_the_step_loss_is_the_mean_over_every_label_of_the_step():
    """Not the mean of the micro-batches' means: rows with more labels count more."""
    rows = packed_rows()
    model, _, step = setup(sgd=True)
    probe = copy.deepcopy(model)
    inputs, labels, _, _ = rows
    with torch.no_grad():
        logits = probe(inputs).float()
    per_token = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), labels, reduction="none", ignore_index=IGNORE_INDEX
    )
    expected = (per_token.sum() / (labels != IGNORE_INDEX).sum()).item()
    result = step(split_rows(rows, 1, packed=False), LoopState())
    assert result.loss == pytest.approx(expected, rel=1e-6)


MTP = attrs.evolve(CFG, mtp_depth=2)


@pytest.mark.parametrize("chunk", [0, 5], ids=["plain", "chunked"])
@pytest.mark.parametrize("micro", [8, 2, 1])
def test_every_depths_target_weighs_alike_however_the_batch_is_split(chunk, micro):
    """With two multi-token depths, packed rows of unequal label counts: the step's loss, its
    depths' losses and its update do not depend on the split (4x2 the baseline), and each
    depth's logged loss is the mean over every one of its targets."""
    from forge.model.mtp import depth_targets

    rows = packed_rows()
    loss = LossSpec(chunk_size=chunk, mtp_weight=0.3)
    m_ref, _, step_ref = setup(sgd=True, cfg=MTP, loss=loss)
    m, _, step = setup(sgd=True, cfg=MTP, loss=loss)
    probe = copy.deepcopy(m)
    before = [p.detach().clone() for p in m.parameters()]
    ref = step_ref(split_rows(rows, 4, True), LoopState())
    got = step(split_rows(rows, micro, True), LoopState())
    assert got.mtp is not None and ref.mtp is not None and len(got.mtp) == 2
    assert got.loss == pytest.approx(ref.loss, rel=1e-6)
    assert list(got.mtp) == pytest.approx(list(ref.mtp), rel=1e-6)
    for p0, p_ref, p in zip(before, m_ref.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(p - p0, p_ref - p0, rtol=1e-5, atol=1e-7)
    inputs, labels, positions, documents = rows
    whole = Batch(inputs, labels, positions, documents)
    terms = micro_batch_loss(probe, whole, contextlib.nullcontext, None, loss)
    assert terms.depths is not None
    for k in (1, 2):
        targets = (depth_targets(inputs, labels, k)[1] != IGNORE_INDEX).sum().item()
        assert got.mtp[k - 1] == pytest.approx(terms.depths[k - 1].item() / targets, rel=1e-5)
