"""Mixture of experts: routing, capacity, the auxiliary losses, the balancing bias, metrics
and config rules, each against hand-worked values."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from forge.config import ConfigError, load_config
from forge.config.sections import ModelConfig, MoeRouter
from forge.metrics.flops import (
    feed_forward_parameters,
    flops_per_token,
    non_embedding_parameters,
)
from forge.metrics.moe import load_cv, moe_metrics
from forge.metrics.reduction import packed, unpacked
from forge.model.feed_forward import FeedForward
from forge.model.moe import (
    AUX,
    DROPPED,
    LOADS,
    MoE,
    Routing,
    Z,
    balance_loss,
    empty_stats,
    expert_capacity,
    grouped_swiglu,
    route,
    router_z_loss,
    sort_by_expert,
)
from forge.model.transformer import Transformer, num_parameters
from forge.parallel.world import parallel_problems
from forge.training.loop.expert_balance import bias_update
from forge.types import MoeStepStats, StepResult

# two tokens, three experts
LOGITS = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.5, 3.0]])


def test_softmax_routing_takes_the_top_k_probabilities_renormalised():
    routing = route(LOGITS, 2, MoeRouter.SOFTMAX)
    assert routing.experts.tolist() == [[0, 1], [2, 1]]
    p = LOGITS.softmax(-1)
    first = torch.tensor([p[0, 0], p[0, 1]]) / (p[0, 0] + p[0, 1])
    torch.testing.assert_close(routing.weights[0], first)
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(routing.probs, p)


def test_sigmoid_routing_normalises_the_chosen_scores():
    routing = route(LOGITS, 2, MoeRouter.SIGMOID)
    s = LOGITS.sigmoid()
    assert routing.experts.tolist() == [[0, 1], [2, 1]]
    expected = torch.stack([s[0, [0, 1]] / s[0, [0, 1]].sum(), s[1, [2, 1]] / s[1, [2, 1]].sum()])
    torch.testing.assert_close(routing.weights, expected)
    torch.testing.assert_close(routing.probs, s / s.sum(-1, keepdim=True))


def test_the_balancing_bias_changes_the_choice_but_not_the_weights():
    bias = torch.tensor([0.0, 0.0, 5.0])  # expert 2 strongly favoured
    routing = route(LOGITS, 1, MoeRouter.SIGMOID, bias)
    assert routing.experts.tolist() == [[2], [2]]
    torch.testing.assert_close(routing.weights, torch.ones(2, 1))  # normalised over one choice
    two = route(LOGITS, 2, MoeRouter.SIGMOID, bias)
    s = LOGITS.sigmoid()
    assert two.experts[0].tolist() == [2, 0]
    torch.testing.assert_close(two.weights[0], s[0, [2, 0]] / s[0, [2, 0]].sum())


def reference_group_routing(scores, bias, n_groups, top_groups, top_k, scale):
    """DeepSeek-V3's group-limited choice written out token by token (its reference
    inference code's rule): groups scored by their two best biased scores, the best
    ``top_groups`` kept, the rest's experts out, the top-k of what is left; the weights
    are the unbiased scores of the chosen, normalised, times ``scale``."""
    experts, weights = [], []
    size = scores.shape[1] // n_groups
    for s in scores:
        choice = [float(v) for v in s + bias]
        ranked_groups = sorted(
            range(n_groups),
            key=lambda g: -sum(sorted(choice[g * size : (g + 1) * size], reverse=True)[:2]),
        )
        kept = set(ranked_groups[:top_groups])
        masked = [v if i // size in kept else -math.inf for i, v in enumerate(choice)]
        chosen = sorted(range(len(masked)), key=lambda i: -masked[i])[:top_k]
        total = sum(float(s[i]) for i in chosen)
        experts.append(sorted(chosen))
        weights.append({i: float(s[i]) / total * scale for i in chosen})
    return experts, weights


@pytest.mark.parametrize(
    ("n_groups", "top_groups", "top_k", "scale", "bias_scale"),
    [(4, 2, 3, 2.5, 0.0), (4, 1, 2, 1.0, 0.3), (2, 1, 4, 1.0, 0.0), (8, 3, 6, 0.5, 0.1)],
)
def test_group_limited_routing_chooses_within_the_best_groups(
    n_groups, top_groups, top_k, scale, bias_scale
):
    gen = torch.Generator().manual_seed(n_groups * 10 + top_k)
    logits = torch.randn(64, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * bias_scale
    routing = route(logits, top_k, MoeRouter.SIGMOID, bias, (n_groups, top_groups), scale)
    experts, weights = reference_group_routing(
        logits.sigmoid(), bias, n_groups, top_groups, top_k, scale
    )
    assert sorted(map(sorted, routing.experts.tolist())) == sorted(experts)
    for row, chosen, expected in zip(routing.experts, routing.weights, weights, strict=True):
        for e, w in zip(row.tolist(), chosen.tolist(), strict=True):
            assert w == pytest.approx(expected[e], rel=1e-6)


def test_a_negative_bias_never_routes_outside_the_chosen_groups():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=gen)
    bias = torch.full((8,), -0.9)  # every choice score below 0
    routing = route(logits, 2, MoeRouter.SIGMOID, bias, (4, 1))
    groups = (logits.sigmoid() + bias).view(64, 4, 2).topk(2, dim=-1).values.sum(-1).argmax(-1)
    assert torch.equal(routing.experts // 2, groups[:, None].expand(-1, 2))
    plain = route(logits, 2, MoeRouter.SIGMOID, None, (4, 1))
    assert torch.equal(routing.experts.sort().values, plain.experts.sort().values)  # shift-free


def test_one_group_is_plain_sigmoid_routing_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(32, 8, generator=gen), torch.randn(8, generator=gen) * 0.1
    plain = route(logits, 2, MoeRouter.SIGMOID, bias)
    grouped = route(logits, 2, MoeRouter.SIGMOID, bias, (1, 1), 1.0)
    assert torch.equal(plain.experts, grouped.experts)
    assert torch.equal(plain.weights, grouped.weights)


@pytest.mark.parametrize(
    ("tokens", "k", "experts", "factor", "capacity"),
    [
        (8, 2, 4, 1.0, 4),
        (8, 2, 4, 1.25, 5),
        (10, 1, 4, 1.0, 3),  # ceil(2.5)
        (8, 2, 4, 0.0, None),  # dropless
    ],
)
def test_expert_capacity(tokens, k, experts, factor, capacity):
    assert expert_capacity(tokens, k, experts, factor) == capacity


def routing_of(experts: list[list[int]], n_experts: int) -> Routing:
    chosen = torch.tensor(experts)
    weights = torch.full(chosen.shape, 1.0 / chosen.shape[1])
    probs = torch.full((chosen.shape[0], n_experts), 1.0 / n_experts)
    return Routing(chosen, weights, probs)


def test_capacity_drops_the_assignments_past_it_first_choices_first():
    # five tokens all choose expert 0 first; second choices spread over 1 and 2
    routing = routing_of([[0, 1], [0, 2], [0, 1], [0, 1], [0, 2]], 3)
    kept = sort_by_expert(routing, 3, capacity=2)
    assert kept.routed.tolist() == [5, 3, 2]
    assert kept.counts.tolist() == [2, 2, 2]  # 3 + 1 assignments dropped
    assert kept.tokens.tolist() == [0, 1, 0, 2, 1, 4]  # expert 0: tokens 0, 1; expert 1: 0, 2
    dropless = sort_by_expert(routing, 3, capacity=None)
    assert dropless.counts.tolist() == [5, 3, 2]
    assert dropless.tokens.tolist() == [0, 1, 2, 3, 4, 0, 2, 3, 1, 4]


@pytest.mark.parametrize(
    ("experts", "n_experts", "counts"),
    [
        ([[2, 2], [2, 2]], 5, [0, 0, 4, 0, 0]),  # empty experts before and after
        ([[4, 0]], 5, [1, 0, 0, 0, 1]),  # empty ones between
        ([[1, 3], [3, 1], [0, 3]], 4, [1, 2, 0, 3]),
    ],
)
def test_each_experts_rows_are_counted_empty_experts_included(experts, n_experts, counts):
    assert sort_by_expert(routing_of(experts, n_experts), n_experts, None).counts.tolist() == counts


def test_the_counts_equal_bincount_over_random_routings():
    """Top-k of 1 to 8 experts (each token's k distinct), no token included."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        n_experts = int(torch.randint(1, 9, (1,), generator=generator))
        k = int(torch.randint(1, n_experts + 1, (1,), generator=generator))
        tokens = int(torch.randint(0, 20, (1,), generator=generator))
        scores = torch.rand(tokens, n_experts, generator=generator)
        experts = scores.topk(k, dim=-1).indices
        routing = Routing(experts, torch.full(experts.shape, 1.0 / k), scores)
        chosen = sort_by_expert(routing, n_experts, None)
        assert torch.equal(chosen.counts, torch.bincount(experts.flatten(), minlength=n_experts))
        # every row sits in its expert's slice: the (expert, token) pairs are the routing's
        row_expert = torch.arange(n_experts).repeat_interleave(chosen.counts)
        pairs = sorted(zip(row_expert.tolist(), chosen.tokens.tolist(), strict=True))
        assert pairs == sorted((e, i) for i, row in enumerate(experts.tolist()) for e in row)


def test_the_balancing_loss_is_one_when_balanced_and_matches_a_hand_computation():
    probs = torch.full((4, 2), 0.5)
    assert balance_loss(probs, torch.tensor([2, 2])).item() == pytest.approx(1.0)
    probs = torch.tensor([[0.9, 0.1], [0.7, 0.3]])
    counts = torch.tensor([3, 1])  # f = (0.75, 0.25); P = (0.8, 0.2)
    assert balance_loss(probs, counts).item() == pytest.approx(2 * (0.75 * 0.8 + 0.25 * 0.2))


def test_the_router_z_loss_is_the_mean_squared_logsumexp():
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS.tolist()) / 2
    assert router_z_loss(LOGITS).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("bias", "loads", "rate", "expected"),
    [
        ([0.0, 0.0, 0.0, 0.0], [4, 4, 4, 4], 0.1, [0.0, 0.0, 0.0, 0.0]),  # balanced: no change
        ([0.0, 0.0, 0.0, 0.0], [10, 2, 2, 2], 0.1, [-0.1, 0.1, 0.1, 0.1]),
        ([0.5, -0.5, 0.0, 0.0], [1, 7, 4, 4], 0.01, [0.51, -0.51, 0.0, 0.0]),  # at mean: kept
    ],
)
def test_the_bias_update_rule(bias, loads, rate, expected):
    got = bias_update(torch.tensor(bias), torch.tensor(loads, dtype=torch.float32), rate)
    torch.testing.assert_close(got, torch.tensor(expected))


def test_one_expert_top_1_dropless_equals_the_dense_swiglu():
    cfg = ModelConfig(
        dim=16, n_layers=1, n_heads=2, ffn_hidden_dim=24, moe_num_experts=1, moe_top_k=1
    )
    torch.manual_seed(0)
    moe, dense = MoE(cfg, 0), FeedForward(16, 24)
    with torch.no_grad():
        moe.router.gate.weight.normal_()
        moe.experts.w1.copy_(dense.w1.weight.t()[None])
        moe.experts.w3.copy_(dense.w3.weight.t()[None])
        moe.experts.w2.copy_(dense.w2.weight.t()[None])
    x = torch.randn(2, 5, 16)
    out, stats = moe(x, empty_stats(cfg, "cpu"))
    torch.testing.assert_close(out, dense(x))
    assert stats[0, LOADS].item() == 10 and stats[0, DROPPED].item() == 0


@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 8], [8, 0, 0]])
def test_grouped_gemm_equals_a_matmul_per_expert(counts):
    torch.manual_seed(1)
    x = torch.randn(8, 16, requires_grad=True)
    w1, w3 = torch.randn(3, 16, 8), torch.randn(3, 16, 8)
    w2 = torch.randn(3, 8, 16)
    c = torch.tensor(counts)
    out = grouped_swiglu(x, c, w1, w2, w3)  # fp32 on a CPU: torch._grouped_mm
    rows = x.split(counts)
    expected = torch.cat(
        [(torch.nn.functional.silu(r @ w1[e]) * (r @ w3[e])) @ w2[e] for e, r in enumerate(rows)]
    )
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, grad)
    (ex,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(gx, ex)


def test_router_logits_are_fp32_under_bf16_autocast():
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, moe_num_experts=4)
    moe = MoE(cfg, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe.router(torch.randn(3, 16)).dtype == torch.float32
    moe.to(torch.bfloat16)
    assert moe.router.expert_bias.dtype == torch.float32  # the bias keeps its precision


def test_the_model_returns_its_statistics_and_the_losses_reach_the_router():
    cfg = ModelConfig(
        dim=16, n_layers=3, n_heads=2, vocab_size=32, max_seq_len=8, moe_num_experts=4,
        moe_first_dense=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    logits, stats = model(torch.randint(0, 32, (2, 8)))
    assert logits.shape == (2, 8, 32) and stats.shape == (2, LOADS + 4)
    assert stats[:, LOADS:].sum(-1).tolist() == [32.0, 32.0]  # 16 tokens × top-2 per layer
    (stats[:, AUX].sum() + stats[:, Z].sum()).backward()
    gate = model.layers["1"].feed_forward.router.gate.weight  # type: ignore[union-attr]
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_a_group_limited_layer_routes_within_its_groups_and_scales_its_output():
    base = ModelConfig(
        dim=16, n_layers=1, n_heads=2, moe_num_experts=8, moe_router=MoeRouter.SIGMOID
    )
    grouped = attrs.evolve(base, moe_num_groups=4, moe_top_groups=1, moe_routed_scale=2.0)
    torch.manual_seed(0)
    plain = MoE(base, 0)
    for param in plain.parameters():
        torch.nn.init.normal_(param, std=0.1)
    limited = MoE(grouped, 0)
    limited.load_state_dict(plain.state_dict())
    x = torch.randn(64, 16)
    stats = torch.zeros(1, LOADS + 8)
    _, row = limited(x, stats)
    logits = limited.router(x)
    chosen = route(logits, 2, MoeRouter.SIGMOID, None, (4, 1)).experts
    assert (chosen // 2)[:, 0].eq((chosen // 2)[:, 1]).all()  # both picks in one group of two
    assert row[0, LOADS:].tolist() == torch.bincount(chosen.flatten(), minlength=8).tolist()
    halved = attrs.evolve(grouped, moe_routed_scale=1.0)
    unscaled = MoE(halved, 0)
    unscaled.load_state_dict(plain.state_dict())
    torch.testing.assert_close(limited(x, stats)[0], 2 * unscaled(x, stats)[0])


@pytest.mark.parametrize(
    ("layers", "first_dense", "every", "expected"),
    [
        (4, 0, 1, (0, 1, 2, 3)),
        (4, 1, 1, (1, 2, 3)),  # DeepSeek: the first block dense
        (6, 0, 2, (1, 3, 5)),  # every other block
        (6, 1, 2, (2, 4)),
    ],
)
def test_which_blocks_are_mixtures_of_experts(layers, first_dense, every, expected):
    cfg = ModelConfig(n_layers=layers, moe_num_experts=4, moe_first_dense=first_dense,
                      moe_every=every)  # fmt: skip
    assert cfg.moe_layers == expected


def test_parameter_counts_match_the_built_model():
    cfg = ModelConfig(
        dim=32, n_layers=3, n_heads=4, vocab_size=64, moe_num_experts=6, moe_top_k=2,
        moe_shared_experts=2, moe_hidden_dim=16, moe_first_dense=1,
    )  # fmt: skip
    with torch.device("meta"):
        model = Transformer(cfg)
    embedding = cfg.vocab_size * cfg.dim
    assert non_embedding_parameters(cfg) == num_parameters(model) - embedding
    expert = 3 * 32 * 16
    assert feed_forward_parameters(cfg, 1) == 32 * 6 + (6 + 2) * expert
    assert feed_forward_parameters(cfg, 1, active=True) == 32 * 6 + (2 + 2) * expert
    assert feed_forward_parameters(cfg, 0) == 3 * 32 * cfg.hidden_dim
    # MFU counts what a token passes through: the active parameters, not every expert
    active = non_embedding_parameters(cfg, active=True)
    assert active == non_embedding_parameters(cfg) - 2 * (6 - 2) * expert
    assert flops_per_token(cfg, 16) == 6 * active + 12 * 3 * 32 * 16


@pytest.mark.parametrize(
    ("loads", "cv"),
    [([4, 4, 4, 4], 0.0), ([8, 0, 0, 0], math.sqrt(3)), ([2, 6], 0.5), ([0, 0], 0.0)],
)
def test_load_cv(loads, cv):
    assert load_cv(loads) == pytest.approx(cv)


def test_moe_metrics_average_over_ranks_and_layers():
    """Two ranks' statistics, packed and summed as the one reduction over ranks does."""
    ranks = [
        MoeStepStats(2.0, 0.4, 1.0, 8.0, ((3.0, 1.0), (1.0, 3.0))),
        MoeStepStats(0.4, 0.2, 2.0, 4.0, ((1.0, 3.0), (1.0, 3.0))),
    ]
    metrics = [moe_metrics(stats) for stats in ranks]
    sums = [sum(v) for v in zip(*(packed(m, 2, r) for r, m in enumerate(metrics)), strict=True)]
    assert unpacked(metrics[0], sums, world=2, slices=2) == pytest.approx(
        {
            "moe/aux_loss": 1.2,
            "moe/z_loss": 0.3,
            "moe/dropped_fraction": 0.25,
            "moe/load_cv": 0.25,  # summed loads (4, 4) and (2, 6): (0 + 0.5) / 2
        }
    )


def test_no_assignment_is_no_dropped_fraction():
    stats = MoeStepStats(0.0, 0.0, 0.0, 0.0, ((0.0, 0.0),))
    metrics = moe_metrics(stats)
    record = unpacked(metrics, packed(metrics, 1, 0), world=1, slices=1)
    assert record["moe/dropped_fraction"] == 0.0 and record["moe/load_cv"] == 0.0


@pytest.mark.parametrize(
    ("aux", "z", "finite"),
    [(1.0, 0.5, True), (math.nan, 0.5, False), (1.0, math.inf, False)],
)
def test_a_non_finite_auxiliary_loss_makes_the_step_non_finite(aux, z, finite):
    result = StepResult(2.0, 1.0, 64, 1e-3, moe=MoeStepStats(aux, z, 0.0, 8.0, ((4.0, 4.0),)))
    assert result.finite is finite


def problems_of(tmp_path, *args: str, world: int = 1) -> list[str]:
    path = tmp_path / "c.toml"
    path.write_text('[model]\ndim = 32\nn_heads = 4\n[data]\npath = "x"\n')
    try:
        config = load_config([str(path), *args]).config
    except ConfigError as exc:
        return exc.lines
    return [f"{k}: {m}" for k, m in parallel_problems(config, world)]


def _groups(
    experts: int, groups: int, top: int, router: str = "sigmoid", top_k: int = 2, scale="2.5"
) -> list[str]:
    return [
        f"--model.moe_num_experts={experts}",
        f"--model.moe_num_groups={groups}",
        f"--model.moe_top_groups={top}",
        f"--model.moe_router={router}",
        f"--model.moe_top_k={top_k}",
        f"--model.moe_routed_scale={scale}",
    ]


@pytest.mark.parametrize(
    ("args", "world", "fragment"),
    [
        (["--model.moe_num_experts=4", "--model.moe_top_k=5"], 1, "model.moe_top_k: must be <="),
        (["--model.moe_num_experts=-1"], 1, "model.moe_num_experts: must be >= 0"),
        (["--model.moe_num_experts=4", "--model.moe_capacity_factor=-1"], 1, "capacity_factor"),
        (["--model.moe_num_experts=4", "--model.moe_aux_loss_weight=nan"], 1, "aux_loss_weight"),
        (["--model.moe_num_experts=4", "--model.moe_bias_update_rate=0.01"], 1, "'sigmoid'"),
        (["--model.moe_num_experts=4", "--model.moe_first_dense=4"], 1, "no mixture-of-experts"),
        (["--model.moe_num_experts=4", "--model.moe_every=0"], 1, "model.moe_every: must be > 0"),
        (_groups(8, 4, 2, router="softmax"), 1, "group-limited routing needs moe_router="),
        (_groups(8, 3, 1), 1, "model.moe_num_groups: must split model.moe_num_experts=8"),
        (_groups(8, 8, 1), 1, "groups of 2 or more"),
        (_groups(8, 2, 3), 1, "model.moe_top_groups: must be <= model.moe_num_groups=2"),
        (_groups(8, 4, 1, top_k=3), 1, "model.moe_top_k: must be <= the experts of the chosen"),
        (_groups(8, 0, 1), 1, "model.moe_num_groups: must be > 0"),
        (_groups(8, 1, 1, scale="0"), 1, "model.moe_routed_scale: must be a finite number > 0"),
        (_groups(8, 1, 1, scale="inf"), 1, "model.moe_routed_scale: expected a finite number"),
        (["--distributed.ep=2"], 2, "distributed.ep: needs mixture-of-experts"),
        (["--model.moe_num_experts=3", "--distributed.ep=2"], 2, "must divide model.moe_num"),
        (["--model.moe_num_experts=6", "--distributed.ep=3"], 4, "must divide distributed.dp_sh"),
        (
            [
                "--model.moe_num_experts=4",
                "--distributed.tp=2",
                "--distributed.ep=2",
                "--distributed.dp_shard=2",
            ],
            4,
            "distributed.tp: tensor parallelism is not supported together with expert",
        ),
    ],
)
def test_moe_config_refusals_name_the_key(tmp_path, args, world, fragment):
    problems = problems_of(tmp_path, *args, world=world)
    assert any(fragment in line for line in problems), problems


@pytest.mark.parametrize(
    ("args", "world"),
    [
        (["--distributed.ep=2", "--distributed.dp_shard=2"], 2),
        (["--distributed.ep=2", "--distributed.dp_shard=4"], 4),  # experts FSDP-sharded 2 ways
        (["--distributed.ep=2", "--distributed.dp_replicate=2", "--distributed.dp_shard=2"], 4),
        (["--distributed.ep=2", "--distributed.pp=2", "--train.grad_accum_steps=2"], 4),
        (["--distributed.tp=2", "--distributed.dp_shard=1"], 2),  # experts whole on each peer
        (["--distributed.tp=2", "--distributed.dp_shard=2"], 4),
    ],
)
def test_valid_expert_parallel_layouts_have_no_problems(tmp_path, args, world):
    assert problems_of(tmp_path, "--model.moe_num_experts=4", *args, world=world) == []
