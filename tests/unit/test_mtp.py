"""Multi-token prediction (``forge.model.mtp``): which targets each depth has (the row's end,
packed documents), a depth's loss computed independently of the model's code, chunked equal
to plain, every depth's target weighing the same at any split of a step, the step's logged
depth losses, and the refusals."""

from __future__ import annotations

import contextlib

import attrs
import pytest
import torch
import torch.nn.functional as F

from forge.config.model import ModelConfig, MoeRouter
from forge.data.batch import Batch
from forge.data.packing import IGNORE_INDEX
from forge.metrics.flops import flops_per_token
from forge.model.chunked_loss import PLAIN_LOSS, LossSpec
from forge.model.mtp import depth_counts, depth_targets
from forge.model.transformer import Transformer, num_parameters
from forge.training.steps.common import micro_batch_loss

X = IGNORE_INDEX


@pytest.mark.parametrize(
    ("labels", "depth", "tokens", "targets"),
    [
        # inputs 10..15, labels 11..16: depth 1 embeds token i+1 and predicts i+2
        ([[11, 12, 13, 14, 15, 16]], 1, [[11, 12, 13, 14, 15, 0]], [[12, 13, 14, 15, 16, X]]),
        ([[11, 12, 13, 14, 15, 16]], 2, [[12, 13, 14, 15, 0, 0]], [[13, 14, 15, 16, X, X]]),
        # a packed boundary after position 2 (its label masked): no depth predicts across it
        ([[11, 12, X, 14, 15, 16]], 1, [[11, 12, 13, 14, 15, 0]], [[12, X, X, 15, 16, X]]),
        ([[11, 12, X, 14, 15, 16]], 2, [[12, 13, 14, 15, 0, 0]], [[X, X, X, 16, X, X]]),
        # the depth as long as the row: nothing left
        ([[11, 12]], 2, [[0, 0]], [[X, X]]),
    ],
)
def test_each_depth_predicts_within_the_row_and_the_document(labels, depth, tokens, targets):
    t = len(labels[0])
    inputs = torch.arange(10, 10 + t)[None]
    got_tokens, got_targets = depth_targets(inputs, torch.tensor(labels), depth)
    assert got_targets.tolist() == targets
    valid = got_targets != X
    assert got_tokens[valid].tolist() == torch.tensor(tokens)[valid].tolist()
    counts = depth_counts(torch.tensor(labels), depth)
    assert counts[-1].item() == valid.sum().item()


CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, mtp_depth=2)


def model(cfg: ModelConfig = CFG, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


def reference_depth_sums(m: Transformer, inputs: torch.Tensor, labels: torch.Tensor) -> list:
    """Each depth's summed cross-entropy written out from DeepSeek-V3's description, by
    truncating the sequence (as its reference code does) instead of masking it."""
    t = inputs.shape[1]
    h = m.tok_embeddings(inputs)  # type: ignore[misc]
    for layer in m.layers.values():
        h = layer(h, m.rope_cos, m.rope_sin)
    full = torch.cat([inputs, labels[:, -1:]], dim=1)  # tokens 0 … t
    sums = []
    for k, module in m.mtp.items():  # type: ignore[union-attr]
        k = int(k)
        emb = m.tok_embeddings(F.pad(full, (0, k))[:, k : t + k])  # type: ignore[misc]
        h, normed, _ = module(h, emb, m.rope_cos, m.rope_sin, None)
        logits = F.linear(normed, m.output.weight)[:, : t - k]  # type: ignore[union-attr]
        sums.append(F.cross_entropy(logits.transpose(1, 2), full[:, k + 1 :], reduction="sum"))
    return [s.item() for s in sums]


def test_a_depths_loss_is_deepseeks_and_chunked_equals_plain():
    m = model()
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = Batch(x[:, :-1], x[:, 1:])
    plain = micro_batch_loss(m, batch, contextlib.nullcontext, None, PLAIN_LOSS)
    chunked = micro_batch_loss(m, batch, contextlib.nullcontext, None, LossSpec(chunk_size=5))
    assert plain.depths is not None and chunked.depths is not None
    expected = reference_depth_sums(m, batch.inputs, batch.labels)
    assert plain.depths.tolist() == pytest.approx(expected, rel=1e-5)
    assert chunked.depths.tolist() == pytest.approx(expected, rel=1e-5)
    assert chunked.loss.item() == pytest.approx(plain.loss.item(), rel=1e-6)  # main unchanged
    chunked.depths.sum().backward()  # the depths train their own weights and the shared head
    assert m.mtp["1"].proj.weight.grad is not None  # type: ignore[index,union-attr]
    assert m.output.weight.grad is not None and m.output.weight.grad.abs().sum() > 0


def test_the_main_model_is_unchanged_by_its_depths():
    """A model with depths computes the same main logits as the same weights without them."""
    with_depths, without = model(CFG), model(attrs.evolve(CFG, mtp_depth=0))
    missing = without.load_state_dict(with_depths.state_dict(), strict=False)
    assert all(k.startswith("mtp.") for k in missing.unexpected_keys) and not missing.missing_keys
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(with_depths(x), without(x), rtol=0, atol=0)


def test_parameter_count_and_flops_count_the_depths():
    from forge.config.shapes import forge_shapes, mtp_shapes

    m = model()
    counted = sum(p.numel() for n, p in m.named_parameters() if n.startswith("mtp."))
    assert counted == sum(torch.Size(s).numel() for s in mtp_shapes(CFG).values())
    assert num_parameters(m) == counted + sum(
        torch.Size(s).numel() for s in forge_shapes(CFG).values()
    )
    plain = attrs.evolve(CFG, mtp_depth=0)
    extra = flops_per_token(CFG, 16) - flops_per_token(plain, 16)
    per_depth = 6 * (counted / 2 + CFG.vocab_size * CFG.dim) + 12 * 4 * 8 * 16
    assert extra == pytest.approx(2 * per_depth)


def test_the_memory_plan_counts_the_depths_parameters(tmp_path):
    from forge.config import load_config
    from forge.parallel.memory_plan import stage_parameters

    path = tmp_path / "c.toml"
    path.write_text('[model]\ndim = 32\nn_layers = 2\nn_heads = 4\nvocab_size = 64\n'
                    'max_seq_len = 16\n[train]\nseq_len = 16\n[data]\npath = "x"\n')  # fmt: skip
    plain = load_config([str(path)]).config
    deep = load_config([str(path), "--model.mtp_depth=2"]).config
    (total0, matrices0), (total2, matrices2) = stage_parameters(plain, 1), stage_parameters(deep, 1)
    depths = sum(p.numel() for n, p in model().named_parameters() if n.startswith("mtp."))
    assert total2 - total0 == depths
    assert 0 < matrices2 - matrices0 < depths  # the norms are no matrices


def test_evaluation_reads_the_main_loss_only():
    m = model()
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(2))
    batch = Batch(x[:, :-1], x[:, 1:])
    trained = micro_batch_loss(m, batch, contextlib.nullcontext, None, PLAIN_LOSS)
    m.eval()
    evaluated = micro_batch_loss(m, batch, contextlib.nullcontext, None, PLAIN_LOSS)
    assert trained.depths is not None and evaluated.depths is None  # no depth computed
    assert evaluated.loss.item() == pytest.approx(trained.loss.item(), rel=1e-6)


def test_activation_checkpointing_and_muon_reach_the_depths():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from forge.config.sections import ActivationCheckpointing
    from forge.optim.param_groups import uses_muon
    from forge.parallel.parallelize import apply_activation_checkpointing, sharding_units

    m = model()
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    batch = Batch(x[:, :-1], x[:, 1:])
    before = micro_batch_loss(m, batch, contextlib.nullcontext, None, PLAIN_LOSS).depths
    apply_activation_checkpointing(m, ActivationCheckpointing.FULL)
    assert all(isinstance(d.block, CheckpointWrapper) for d in m.mtp.values())  # type: ignore[union-attr]
    after = micro_batch_loss(m, batch, contextlib.nullcontext, None, PLAIN_LOSS).depths
    assert before is not None and after is not None and torch.equal(before, after)
    assert set(m.mtp.values()) <= set(sharding_units(m))  # type: ignore[union-attr]
    depth_matrices = [n for n, p in m.named_parameters() if n.startswith("mtp.") and p.ndim == 2]
    assert depth_matrices and all(
        uses_muon(n, p) for n, p in m.named_parameters() if n in depth_matrices
    )


@pytest.mark.parametrize("chunk", [0, 4], ids=["plain", "chunked"])
def test_a_micro_batch_without_a_depths_target_adds_nothing_and_stays_finite(chunk):
    """Labels whose runs are all shorter than the depth (every other one masked): depth 1 has
    no target there; its sum is 0, finite, and so is the gradient (the chunked loss once
    divided 0 by 0)."""
    m = model(attrs.evolve(CFG, mtp_depth=1))
    x = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(4))
    labels = x[:, 1:].clone()
    labels[:, ::2] = IGNORE_INDEX
    terms = micro_batch_loss(m, Batch(x[:, :-1], labels), contextlib.nullcontext, None,
                             LossSpec(chunk_size=chunk))  # fmt: skip
    assert terms.depths is not None and terms.depths.tolist() == [0.0]
    (terms.objective + terms.depths.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    masked = micro_batch_loss(m, Batch(x[:, :-1], torch.full_like(labels, IGNORE_INDEX)),
                              contextlib.nullcontext, None, LossSpec(chunk_size=chunk))  # fmt: skip
    assert torch.isfinite(masked.objective) and masked.objective.item() == 0.0


MOE_DEPTHS = attrs.evolve(
    CFG, moe_num_experts=4, moe_top_k=2, moe_first_dense=1, moe_router=MoeRouter.SIGMOID,
    mtp_moe=True,
)  # fmt: skip


def test_with_mtp_moe_each_depths_block_is_a_mixture_of_experts_counted_as_one():
    """DeepSeek-V3's form: depth k's block is MoE block ``n_layers + k - 1``, its parameters
    named as a main MoE block's, its active experts only in the FLOPs, its statistics in the
    rows after the main blocks' (filled in training, empty in evaluation)."""
    from forge.config.shapes import block_shapes, mtp_shapes
    from forge.model.moe import ASSIGNED, MoE

    m = model(MOE_DEPTHS)
    assert MOE_DEPTHS.moe_layers == (1, 2, 3)  # main block 1, then depths 1 and 2
    assert all(isinstance(d.block.feed_forward, MoE) for d in m.mtp.values())  # type: ignore[union-attr]
    # the checkpoint's tensors: parameters and saved buffers
    named = {n: tuple(t.shape) for n, t in m.state_dict().items() if n.startswith("mtp.")}
    assert named == mtp_shapes(MOE_DEPTHS)
    assert {n.removeprefix("mtp.1.block.") for n in named if n.startswith("mtp.1.block.")} == set(
        block_shapes(MOE_DEPTHS, 1)
    )  # a main MoE block's names
    dense_depths = attrs.evolve(MOE_DEPTHS, mtp_moe=False)
    extra = flops_per_token(MOE_DEPTHS, 16) - flops_per_token(dense_depths, 16)
    routed = 3 * 32 * MOE_DEPTHS.expert_hidden_dim  # one expert's w1, w2, w3
    dense_ffn = 3 * 32 * MOE_DEPTHS.hidden_dim
    assert extra == pytest.approx(2 * 6 * (4 * 32 + 2 * routed - dense_ffn))  # gate + top-2

    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    batch = Batch(x[:, :-1], x[:, 1:])
    trained = micro_batch_loss(m, batch, contextlib.nullcontext, None, PLAIN_LOSS)
    assert trained.moe is not None and trained.moe.shape[0] == 3
    assert trained.moe[:, ASSIGNED].tolist() == [2 * 16 * 2] * 3  # tokens × top-k, each block
    m.eval()
    evaluated = micro_batch_loss(m, batch, contextlib.nullcontext, None, PLAIN_LOSS)
    assert evaluated.moe is not None and evaluated.moe[1:, ASSIGNED].tolist() == [0, 0]
    assert evaluated.loss.item() == pytest.approx(trained.loss.item(), rel=1e-6)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"mtp_moe": True}, "model.mtp_moe"),  # a dense model: nothing to make MoE
        ({"mtp_moe": True, "moe_num_experts": 4, "mtp_depth": 0}, "model.mtp_moe"),  # no depth
        ({"mtp_moe": True, "moe_num_experts": 4}, None),
        ({"mtp_moe": False, "moe_num_experts": 4}, None),
    ],
)
def test_mtp_moe_is_refused_where_it_would_change_nothing(changes, named):
    problems = attrs.evolve(CFG, **changes).problems()
    assert [key for key, _ in problems if key == "model.mtp_moe"] == ([named] if named else [])
