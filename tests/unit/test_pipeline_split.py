"""Pipeline stages: the split by parameter count, the stage layouts, what each schedule needs,
the config rules, and the modules a rank holds (built on the meta device; no process group)."""

import attrs
import pytest
import torch
import torch.nn.functional as F

from forge.config import structure_config
from forge.config.sections import DistributedConfig, ModelConfig, PipelineSchedule
from forge.data.packing import IGNORE_INDEX
from forge.model.transformer import Transformer
from forge.parallel.pipeline import (
    HeldEmbedding,
    RankStages,
    rank_model,
    rank_stage_modules,
    stage_boundaries,
)
from forge.parallel.pipeline_loss import StageLoss, stage_sums
from forge.parallel.stages import (
    balanced_boundaries,
    boundary_problems,
    layer_costs,
    local_stages,
    rounds_fit,
    schedule_problems,
    splits_backward,
    stage_layers,
    stage_rank,
)
from forge.parallel.world import parallel_problems

# (case, costs, stages, boundaries)
BALANCED = [
    ("equal costs: the remainder to the first", [1] * 5, 2, (3,)),
    ("equal costs, even", [1] * 4, 2, (2,)),
    ("one layer each", [1] * 4, 4, (1, 2, 3)),
    ("one stage", [3, 1, 2], 1, ()),
    ("a heavy first and last", [5, 1, 1, 1, 1, 5], 3, (1, 5)),
    ("a heavy last, each stage non-empty", [1, 1, 1, 10], 3, (2, 3)),
    ("a heavy middle", [1, 1, 8, 1, 1], 3, (2, 3)),
    ("the largest stage as small as can be", [2, 3, 4, 1, 2, 3], 3, (2, 4)),
]


@pytest.mark.parametrize(
    "costs,stages,bounds", [b[1:] for b in BALANCED], ids=[b[0] for b in BALANCED]
)
def test_balanced_boundaries(costs, stages, bounds):
    assert balanced_boundaries(costs, stages) == bounds


def test_balanced_boundaries_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balanced_boundaries([1, 1], 3)


def test_layer_costs_count_the_embedding_first_and_the_head_last():
    assert layer_costs([10, 10, 10], embedding=7, head=5) == [17, 10, 15]


@pytest.mark.parametrize(
    "bounds,n_layers,ranges",
    [
        ((), 3, [range(0, 3)]),
        ((2,), 4, [range(0, 2), range(2, 4)]),
        ((1, 3), 4, [range(0, 1), range(1, 3), range(3, 4)]),
    ],
)
def test_stage_layers(bounds, n_layers, ranges):
    assert stage_layers(bounds, n_layers) == ranges


# (schedule, pp, stages per rank, rank, its stages)
LAYOUTS = [
    (PipelineSchedule.ONE_F_ONE_B, 2, 1, 1, (1,)),
    (PipelineSchedule.INTERLEAVED_1F1B, 2, 2, 0, (0, 2)),
    (PipelineSchedule.INTERLEAVED_1F1B, 4, 3, 1, (1, 5, 9)),
    (PipelineSchedule.INTERLEAVED_ZERO_BUBBLE, 2, 2, 1, (1, 3)),
    (PipelineSchedule.ZBV, 2, 2, 0, (0, 3)),
    (PipelineSchedule.ZBV, 2, 2, 1, (1, 2)),
    (PipelineSchedule.DUALPIPEV, 4, 2, 1, (1, 6)),
    (PipelineSchedule.DUALPIPEV, 4, 2, 3, (3, 4)),
]


@pytest.mark.parametrize("kind,pp,per_rank,rank,stages", LAYOUTS)
def test_local_stages_and_their_ranks(kind, pp, per_rank, rank, stages):
    assert local_stages(kind, pp, per_rank, rank) == stages
    assert all(stage_rank(kind, pp, per_rank, s) == rank for s in stages)


def test_the_v_layout_puts_the_first_and_last_stage_on_rank_0():
    assert stage_rank(PipelineSchedule.ZBV, 4, 2, 7) == 0
    assert stage_rank(PipelineSchedule.INTERLEAVED_1F1B, 4, 2, 7) == 3


# (case, boundaries, n_layers, stages, problems)
BOUNDARIES = [
    ("fits", (2, 4, 6), 8, 4, []),
    ("too few", (2,), 8, 4, ["needs 3 entries (stages - 1) for 4 stages, got 1"]),
    ("not increasing", (4, 2, 6), 8, 4, ["must be strictly increasing, got [4, 2, 6]"]),
    ("a stage with no layer", (2, 2, 6), 8, 4, ["must be strictly increasing, got [2, 2, 6]"]),
    ("past the layers", (2, 8), 8, 3, ["each entry must lie in 1..7 (model.n_layers=8)"]),
    ("at layer 0", (0, 4), 8, 3, ["each entry must lie in 1..7 (model.n_layers=8)"]),
]


@pytest.mark.parametrize(
    "bounds,n_layers,stages,problems", [b[1:] for b in BOUNDARIES], ids=[b[0] for b in BOUNDARIES]
)
def test_boundary_problems(bounds, n_layers, stages, problems):
    assert boundary_problems(bounds, n_layers, stages) == problems


# (micro-batches, pp, whole rounds): measured on torch 2.13 at pp = 2 and 4
ROUNDS = [(1, 2, True), (3, 2, True), (4, 2, True), (5, 2, False), (6, 2, True), (7, 2, False),
          (5, 4, True), (9, 4, False), (10, 4, True)]  # fmt: skip


@pytest.mark.parametrize("n,pp,fits", ROUNDS)
def test_rounds_fit(n, pp, fits):
    assert rounds_fit(n, pp) is fits


G, ONE, IL, ZB, ZBV, DPV = (
    PipelineSchedule.GPIPE,
    PipelineSchedule.ONE_F_ONE_B,
    PipelineSchedule.INTERLEAVED_1F1B,
    PipelineSchedule.INTERLEAVED_ZERO_BUBBLE,
    PipelineSchedule.ZBV,
    PipelineSchedule.DUALPIPEV,
)
# (schedule, pp, stages per rank, micro-batches, the keys of its problems): torch 2.13's rules
NEEDS = [
    (G, 2, 1, 1, []),
    (G, 2, 2, 4, ["distributed.pp_stages_per_rank"]),
    (ONE, 2, 1, 1, ["train.grad_accum_steps"]),
    (ONE, 4, 1, 4, []),
    (IL, 2, 1, 2, []),
    (IL, 2, 3, 3, []),
    (IL, 2, 2, 5, ["train.grad_accum_steps"]),
    (ZB, 4, 2, 9, ["train.grad_accum_steps"]),
    (ZBV, 2, 2, 1, []),
    (ZBV, 2, 1, 4, ["distributed.pp_stages_per_rank"]),
    (DPV, 2, 2, 3, ["train.grad_accum_steps"]),
    (DPV, 2, 2, 4, []),
    (DPV, 4, 3, 8, ["distributed.pp_stages_per_rank"]),
]


@pytest.mark.parametrize("kind,pp,per_rank,n,keys", NEEDS)
def test_schedule_problems(kind, pp, per_rank, n, keys):
    assert [k for k, _ in schedule_problems(kind, pp, per_rank, n)] == keys


@pytest.mark.parametrize(
    "pp,kind,splits",
    [
        (2, ZB, True),
        (2, ZBV, True),
        (4, DPV, True),
        (2, IL, False),
        (2, ONE, False),
        (1, ZBV, False),
    ],
)
def test_splits_backward_keeps_blocks_eager(pp, kind, splits):
    assert splits_backward(pp, kind) is splits


def test_schedule_problems_name_the_nearest_counts_that_fit():
    (_, message), = schedule_problems(IL, 2, 2, 5)  # fmt: skip
    assert message.endswith(
        "with distributed.pp=2 and pp_schedule='interleaved_1f1b': 4 or 6, not 5"
    )


BASE = {
    "model": {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2},
    "train": {"seq_len": 32, "grad_accum_steps": 4},
}


def cfg(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return structure_config(raw)


PP2 = {"pp": 2, "dp_shard": 1}
# (case, config, world size, expected lines)
RULES = [
    ("interleaved, 2 per rank", cfg(distributed=PP2 | {"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2}), 2, []),
    ("zbv", cfg(distributed=PP2 | {"pp_schedule": "zbv", "pp_stages_per_rank": 2}), 2, []),
    ("zbv, one per rank", cfg(distributed=PP2 | {"pp_schedule": "zbv"}), 2,
     ["distributed.pp_stages_per_rank: must be 2 with distributed.pp_schedule='zbv' (rank r holds stages r and 2*pp-1-r), got 1"]),
    ("more stages than layers", cfg(distributed=PP2 | {"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 3}), 2,
     ["distributed.pp: needs model.n_layers >= 6 stages, got 4"]),
    ("dualpipev, too few micro-batches", cfg(distributed=PP2 | {"pp_schedule": "dualpipev", "pp_stages_per_rank": 2}, train={"grad_accum_steps": 2}, eval={"steps": 2}), 2,
     ["train.grad_accum_steps: must be >= 4 (the stages, 2 per rank) with distributed.pp=2 and pp_schedule='dualpipev'"]),
    ("gpipe, one micro-batch", cfg(distributed=PP2 | {"pp_schedule": "gpipe"}, train={"grad_accum_steps": 1}), 2, []),
    ("boundaries", cfg(distributed=PP2 | {"pp_stage_boundaries": [1]}), 2, []),
    ("boundaries, too many", cfg(distributed=PP2 | {"pp_stage_boundaries": [1, 2]}), 2,
     ["distributed.pp_stage_boundaries: needs 1 entries (stages - 1) for 2 stages, got 2"]),
    ("boundaries without a pipeline", cfg(distributed={"pp_stage_boundaries": [2]}), 1,
     ["distributed.pp_stage_boundaries: needs distributed.pp > 1 (pipeline stages)"]),
    ("stages per rank without a pipeline", cfg(distributed={"pp_stages_per_rank": 2}), 1,
     ["distributed.pp_stages_per_rank: needs distributed.pp > 1 (pipeline stages)"]),
    ("zero bubble, compiled", cfg(distributed=PP2 | {"pp_schedule": "interleaved_zero_bubble"}, train={"compile": True}), 2,
     ["train.compile: is not supported with distributed.pp_schedule='interleaved_zero_bubble' (its backward runs in two halves, which torch 2.13 cannot do for compiled blocks); leave train.compile unset or false"]),
    ("1f1b, compiled", cfg(distributed=PP2, train={"compile": True}), 2, []),
    ("zbv, compile unset: eager", cfg(distributed=PP2 | {"pp_schedule": "zbv", "pp_stages_per_rank": 2}), 2, []),
    ("tied across stages", cfg(distributed=PP2, model={"tie_embeddings": True}), 2, []),
    ("tied in a V", cfg(distributed=PP2 | {"pp_schedule": "zbv", "pp_stages_per_rank": 2}, model={"tie_embeddings": True}), 2, []),
    ("tied in a V under FSDP2", cfg(distributed={"pp": 2, "dp_shard": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2}, model={"tie_embeddings": True}), 4,
     ["distributed.pp_schedule: 'zbv' is not supported with FSDP2 (distributed.dp_replicate, dp_shard or cp > 1) yet: its backward in two halves, inputs then weights, does not yet equal one rank there; use 'gpipe', '1f1b' or 'interleaved_1f1b'"]),
    ("tied in a V under FSDP2 over replicas", cfg(distributed={"pp": 2, "dp_replicate": 2, "dp_shard": 1, "pp_schedule": "dualpipev", "pp_stages_per_rank": 2}, model={"tie_embeddings": True}), 4,
     ["distributed.pp_schedule: 'dualpipev' is not supported with FSDP2 (distributed.dp_replicate, dp_shard or cp > 1) yet: its backward in two halves, inputs then weights, does not yet equal one rank there; use 'gpipe', '1f1b' or 'interleaved_1f1b'"]),
    ("looped zero bubble under FSDP2", cfg(distributed={"pp": 2, "dp_shard": 2, "pp_schedule": "interleaved_zero_bubble"}), 4,
     ["distributed.pp_schedule: 'interleaved_zero_bubble' is not supported with FSDP2 (distributed.dp_replicate, dp_shard or cp > 1) yet: its backward in two halves, inputs then weights, does not yet equal one rank there; use 'gpipe', '1f1b' or 'interleaved_1f1b'"]),
    ("1f1b under FSDP2", cfg(distributed={"pp": 2, "dp_shard": 2}), 4, []),
]  # fmt: skip


@pytest.mark.parametrize("config,world,lines", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_pipeline_rules(config, world, lines):
    assert [f"{k}: {m}" for k, m in parallel_problems(config, world)] == lines


def test_z_loss_and_packing_load_under_pp():
    cfg(distributed=PP2, train={"z_loss_weight": 1e-4}, data={"pack_documents": True})


MODEL = ModelConfig(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=4096, max_seq_len=32)


def meta_model(**changes) -> Transformer:
    with torch.device("meta"):
        return Transformer(attrs.evolve(MODEL, **changes))


def test_stage_boundaries_balance_parameters_with_the_embedding_and_head_counted():
    """A 4096-token vocabulary outweighs a block (8.5k parameters): the first and the last
    of 3 stages hold one block each, beside the embedding and the head."""
    d = DistributedConfig(pp=3)
    assert stage_boundaries(meta_model(), d) == (1, 5)
    assert stage_boundaries(meta_model(vocab_size=8), d) == (2, 4)  # a light vocabulary
    assert stage_boundaries(meta_model(), attrs.evolve(d, pp_stage_boundaries=(3, 4))) == (3, 4)


def names(module: torch.nn.Module) -> list[str]:
    return list(dict(module.named_parameters()))


def test_a_v_rank_holds_the_first_and_last_stage_under_global_names():
    d = DistributedConfig(pp=2, pp_schedule=PipelineSchedule.ZBV, pp_stages_per_rank=2,
                          pp_stage_boundaries=(1, 3, 5))  # fmt: skip
    first, last = rank_stage_modules(meta_model(), d, 0)
    assert list(first.layers) == ["0"] and list(last.layers) == ["5"]
    assert first.output is None and last.tok_embeddings is None
    rank = rank_model([first, last])
    assert isinstance(rank, RankStages)
    assert list(rank.layers) == ["0", "5"]
    top = [n for n in names(rank) if not n.startswith("layers.")]
    assert top == ["tok_embeddings.weight", "norm.weight", "output.weight"]
    assert set(rank.state_dict()) == set(first.state_dict()) | set(last.state_dict())


def test_a_tied_v_rank_shares_one_weight():
    d = DistributedConfig(pp=2, pp_schedule=PipelineSchedule.DUALPIPEV, pp_stages_per_rank=2)
    first, last = rank_stage_modules(meta_model(tie_embeddings=True), d, 0)
    rank = rank_model([first, last])
    assert last.output is not None and first.tok_embeddings is not None
    assert last.output.weight is first.tok_embeddings.weight
    assert "output.weight" not in names(rank) and "output.weight" in rank.state_dict()


@pytest.mark.parametrize("per_rank", [1, 2])
def test_a_tied_head_without_the_embedding_holds_it_under_the_embedding_name(per_rank):
    """The rank with the last stage but not the first: its head's weight is named (and so
    initialised, grouped by the optimizer and saved) as the full tied model's one weight."""
    kind = PipelineSchedule.ONE_F_ONE_B if per_rank == 1 else PipelineSchedule.INTERLEAVED_1F1B
    d = DistributedConfig(pp=2, pp_schedule=kind, pp_stages_per_rank=per_rank)
    stages = rank_stage_modules(meta_model(tie_embeddings=True), d, 1)
    rank = rank_model(stages)
    assert isinstance(rank.tok_embeddings, HeldEmbedding)
    assert names(rank)[0] == "tok_embeddings.weight" and "output.weight" not in names(rank)
    assert {"tok_embeddings.weight", "output.weight"} <= set(rank.state_dict())
    hidden = torch.ones(2, 3)
    assert rank.tok_embeddings(hidden) is hidden  # a later stage's input passes through


def test_stage_loss_weighs_each_label_of_the_step_alike():
    """Two micro-batches of 4 and 1 labels: with one label's weight 1/5, their objectives
    sum to the mean over the 5 labels, and the logged loss is that mean."""
    torch.manual_seed(0)
    logits = torch.randn(2, 1, 4, 7)
    labels = torch.tensor([[[1, 2, 3, 4]], [[5, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]])
    loss = StageLoss()
    loss.weigh(torch.tensor(1 / 5))
    total = sum(loss(logits[i], labels[i]) for i in range(2))
    flat = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(total, flat)
    records = loss.take(2)
    assert [int(r.labels) for r in records] == [4, 1]
    logged, z = stage_sums(records, torch.device("cpu"), with_z=False)
    torch.testing.assert_close(logged, flat)
    assert z is None and loss.take(2) == []


def test_a_forward_hook_on_a_rank_of_several_stages_reaches_each_stage():
    """A ``nan`` fault hooks the rank's model, whose own forward never runs."""
    d = DistributedConfig(pp=2, pp_stages_per_rank=2, pp_schedule=PipelineSchedule.INTERLEAVED_1F1B)
    first, second = stages = rank_stage_modules(meta_model(), d, 0)
    tokens = torch.zeros(1, 4, dtype=torch.long, device="meta")
    seen = []
    handle = rank_model(stages).register_forward_hook(lambda module, *_: seen.append(module))
    second(first(tokens))
    handle.remove()
    first(tokens)
    assert seen == stages


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    ("kind", "per_rank"),
    [
        (PipelineSchedule.ONE_F_ONE_B, 1),
        (PipelineSchedule.INTERLEAVED_1F1B, 2),
        (PipelineSchedule.ZBV, 2),
    ],
    ids=["one stage a rank", "looped", "v layout"],
)
def test_the_last_stage_holds_the_depths_and_an_embedding_for_them_under_global_names(
    kind, per_rank, tied
):
    """Multi-token depths sit with the head; the last stage embeds their tokens with its own
    copy of the embedding (the first stage's own weight where one rank holds both), named as
    the full model's, and takes hidden states, not token ids."""
    full = meta_model(mtp_depth=2, tie_embeddings=tied)
    d = DistributedConfig(pp=2, pp_schedule=kind, pp_stages_per_rank=per_rank)
    ranks = [rank_model(rank_stage_modules(full, d, r)) for r in range(2)]
    every = [s for r in ranks for s in getattr(r, "stages", (r,))]
    last = next(s for s in every if s.output is not None)
    assert [s.mtp is not None for s in every].count(True) == 1 and last.mtp is not None
    assert not last.embeds_tokens and isinstance(last.tok_embeddings, torch.nn.Embedding)
    holder = next(r for r in ranks if last in getattr(r, "stages", (r,)))
    assert names(holder)[0] == "tok_embeddings.weight"
    assert any(n.startswith("mtp.2.") for n in names(holder))
    assert set().union(*(r.state_dict() for r in ranks)) == set(full.state_dict())
    first = next(s for s in every if s.embeds_tokens)
    if kind is PipelineSchedule.ZBV:  # one rank holds both ends: one weight
        assert last.tok_embeddings.weight is first.tok_embeddings.weight  # type: ignore[union-attr]
    if tied:
        assert last.output.weight is last.tok_embeddings.weight
