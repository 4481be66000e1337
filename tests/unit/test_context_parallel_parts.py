"""Context parallelism's pure parts: the head–tail split, batch slicing, the config's
refusals, and the attention of each rank's queries over the gathered keys (in process: the
gather simulated by indexing, so that its backward, a scatter-add, is the reduce-scatter's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forge.config import ConfigError, structure_config
from forge.data.batch import Batch
from forge.data.context_split import context_shard, head_tail_indices
from forge.model.attention import document_attention_mask
from forge.model.block_attention import (
    block_attention,
    chunk_attention,
    dense_keep,
    is_plain,
    key_blocks,
)
from forge.model.context_attention import attend_gathered, in_sequence_order, uses_blocks
from forge.parallel.memory_plan import context_parallel_bytes, memory_plan
from forge.parallel.world import MeshDims, parallel_problems, resolve_dims


@pytest.mark.parametrize(
    ("seq_len", "cp", "rank", "indices"),
    [
        (4, 1, 0, [0, 1, 2, 3]),  # one rank: the whole sequence
        (8, 2, 0, [0, 1, 6, 7]),  # chunks 0 and 3 of 4
        (8, 2, 1, [2, 3, 4, 5]),  # chunks 1 and 2
        (12, 3, 0, [0, 1, 10, 11]),
        (12, 3, 1, [2, 3, 8, 9]),
        (12, 3, 2, [4, 5, 6, 7]),
        (16, 2, 1, [4, 5, 6, 7, 8, 9, 10, 11]),
    ],
)
def test_head_tail_indices(seq_len, cp, rank, indices):
    assert head_tail_indices(seq_len, cp, rank).tolist() == indices


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ranks_cover_the_sequence_once_with_equal_causal_work(cp):
    seq_len = 8 * cp
    every = torch.cat([head_tail_indices(seq_len, cp, r) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(seq_len))
    # causal work of a rank: the keys its queries see, sum of (index + 1)
    work = {int((head_tail_indices(seq_len, cp, r) + 1).sum()) for r in range(cp)}
    assert len(work) == 1


def test_head_tail_indices_refuse_an_uneven_split():
    with pytest.raises(ValueError, match="multiple of 2\\*cp=4"):
        head_tail_indices(6, 2, 0)


def test_context_shard_of_plain_rows_carries_the_global_positions():
    inputs = torch.arange(16).view(2, 8)
    batch = Batch(inputs, inputs + 100, sources=torch.tensor([0, 1]))
    part = context_shard(batch, 2, 1)
    assert part.inputs.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part.labels.tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert part.positions is not None and part.positions.tolist() == [[2, 3, 4, 5]] * 2
    assert part.document_ids is None
    assert part.sources is not None and part.sources.tolist() == [0, 1]  # rows are kept
    assert context_shard(batch, 1, 0) is batch


def test_context_shard_of_packed_rows_keeps_their_positions_and_documents():
    inputs = torch.arange(8).view(1, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    part = context_shard(Batch(inputs, inputs, positions, documents), 2, 0)
    assert part.inputs.tolist() == [[0, 1, 6, 7]]
    assert part.positions is not None and part.positions.tolist() == [[0, 1, 1, 2]]
    assert part.document_ids is not None and part.document_ids.tolist() == [[0, 0, 2, 2]]


def full_attention_mask(t: int, window: int, docs: torch.Tensor | None) -> torch.Tensor:
    if docs is not None:
        return document_attention_mask(docs, window)
    query, key = torch.arange(t)[:, None], torch.arange(t)[None, :]
    keep = key <= query
    return (keep & (query - key < window) if window else keep)[None, None]


ATTENTION_CASES = [
    # (cp, window, packed, dtype)
    (2, 0, False, torch.float32),
    (2, 0, True, torch.float32),
    (2, 5, False, torch.float32),
    (2, 3, True, torch.float32),
    (4, 0, False, torch.float32),
    (4, 3, True, torch.float32),
    (2, 0, True, torch.bfloat16),
]


PATHS = [
    # (path, the cases it serves): the CPU's blocks, and what other devices run
    ("blocks", ATTENTION_CASES),
    ("dense", ATTENTION_CASES),
    ("chunks", [c for c in ATTENTION_CASES if not c[1] and not c[2]]),  # plain rows only
]


@pytest.mark.parametrize(
    ("path", "cp", "window", "packed", "dtype"),
    [(path, *case) for path, cases in PATHS for case in cases],
)
def test_context_attention_equals_full_attention(path, cp, window, packed, dtype):
    """Each simulated rank's queries over the keys in sequence order, block by block, chunk
    by chunk under a lower-right causal mask, or under the blocks' dense mask, give the full
    attention's outputs and (summed over ranks) its gradients, grouped-query heads
    included; a packed row has queries that see nothing of an earlier block (a document
    that starts inside the chunk)."""

    def attend(q, k, v, blocks):
        if path == "blocks":
            return block_attention(q, k, v, blocks)
        if path == "chunks":
            return chunk_attention(q, k, v, blocks, gqa=True)
        keep = dense_keep(blocks, q.shape[2], k.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    assert_context_attention(cp, window, packed, dtype, attend, torch.device("cpu"))


def test_the_device_decides_the_path():
    assert uses_blocks(torch.device("cpu")) and not uses_blocks(torch.device("cuda"))
    assert is_plain(key_blocks(16, 2, 0, 0)) and not is_plain(key_blocks(16, 2, 0, 3))
    assert is_plain(key_blocks(16, 2, 0, 16))  # a window over the whole row is none


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("cp", "window", "packed", "dtype"), ATTENTION_CASES)
def test_context_attention_on_a_gpu_equals_full_attention(cp, window, packed, dtype):
    """What a GPU runs (chunks for plain rows, the dense mask otherwise) equals the full
    attention too."""

    def attend(q, k, v, blocks):
        return attend_gathered(q, k, v, blocks, gqa=True)

    assert_context_attention(cp, window, packed, dtype, attend, torch.device("cuda"))


def assert_context_attention(cp, window, packed, dtype, attend, device):
    torch.manual_seed(0)
    b, t = 2, 16
    q = torch.randn(b, 4, t, 8, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, 2, t, 8, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, 2, t, 8, dtype=dtype, device=device, requires_grad=True)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if packed else None
    docs = None if docs is None else docs.to(device)
    mask = full_attention_mask(t, window, docs).to(device)
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    weight = torch.randn_like(full)
    (full.float() * weight.float()).sum().backward()
    want = [x.grad.clone() for x in (q, k, v)]  # type: ignore[union-attr]
    for x in (q, k, v):
        x.grad = None
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    loss = torch.zeros((), device=device)
    for rank in range(cp):
        mine = head_tail_indices(t, cp, rank).to(device)
        documents = None if docs is None else (docs[:, mine], docs)
        out = attend(q[:, :, mine], k, v, key_blocks(t, cp, rank, window, documents))
        torch.testing.assert_close(out, full[:, :, mine].detach(), **tol)
        loss = loss + (out.float() * weight[:, :, mine].float()).sum()
    loss.backward()
    for got, expected in zip((q.grad, k.grad, v.grad), want, strict=True):
        torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize(
    ("cp", "rank", "window", "blocks"),
    [
        # rank 0 of 2 (chunks 0 and 3 of 4, 4 tokens each): chunk 0 only its diagonal
        (2, 0, 0, [((0, 4), (0, 4), True), ((4, 8), (12, 16), True), ((4, 8), (0, 12), False)]),
        (2, 1, 0, [((0, 4), (4, 8), True), ((0, 4), (0, 4), False), ((4, 8), (8, 12), True),
                   ((4, 8), (0, 8), False)]),
        # a window of 3 needs only the last 2 earlier keys of the chunk's first query
        (2, 1, 3, [((0, 4), (4, 8), False), ((0, 4), (2, 4), False), ((4, 8), (8, 12), False),
                   ((4, 8), (6, 8), False)]),
    ],
)  # fmt: skip
def test_key_blocks_are_the_diagonal_then_the_earlier_keys(cp, rank, window, blocks):
    got = key_blocks(16, cp, rank, window)
    assert [(b.rows, b.keys, b.causal) for b in got] == blocks
    assert all((b.keep is None) == (not window) for b in got)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_in_sequence_order_undoes_the_head_tail_split(cp):
    seq_len = 4 * cp
    parts = torch.stack([head_tail_indices(seq_len, cp, r) for r in range(cp)])
    assert in_sequence_order(parts[:, None], dim=1).flatten().tolist() == list(range(seq_len))


BASE = {
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
    "train": {"seq_len": 32},
}


def cfg(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return structure_config(raw)


def lines(config, world):
    return [f"{k}: {m}" for k, m in parallel_problems(config, world)]


def test_cp_is_a_mesh_dim_and_counts_in_the_world():
    config = cfg(distributed={"cp": 2})
    dims = resolve_dims(config.distributed, 4)
    assert dims == MeshDims(dp_shard=2, cp=2)
    assert dims.named() == (("dp_shard", 2), ("cp", 2))
    assert dims.token_slices == 4 and dims.dp == 2
    assert lines(config, 4) == []
    assert lines(cfg(distributed={"cp": 2, "dp_shard": 1}), 4) == [
        "distributed: pp*dp_replicate*dp_shard*cp*tp = 1*1*1*2*1 = 2, but the world size "
        "is 4; make them equal"
    ]


@pytest.mark.parametrize(
    ("sections", "world", "expected"),
    [
        (
            {"distributed": {"cp": 3}, "train": {"seq_len": 32}},
            3,
            "distributed.cp: 2*cp = 6 must divide train.seq_len=32 (each rank keeps a head "
            "and a tail chunk of every sequence)",
        ),
        (  # sequence parallelism splits each context-parallel rank's 10 tokens
            {
                "distributed": {"cp": 2, "tp": 4, "dp_shard": 1},
                "model": {"n_kv_heads": 4},
                "train": {"seq_len": 20},
            },
            8,
            "distributed.tp: must divide a context-parallel rank's tokens, train.seq_len / "
            "distributed.cp = 10 (sequence parallelism)",
        ),
        (
            {
                "distributed": {
                    "cp": 2,
                    "pp": 2,
                    "dp_shard": 1,
                    "pp_schedule": "zbv",
                    "pp_stages_per_rank": 2,
                },
                "model": {"n_layers": 4},
            },
            4,
            "distributed.pp_schedule: 'zbv' is not supported with FSDP2 (distributed.dp_replicate, "
            "dp_shard or cp > 1) yet: its backward in two halves, inputs then weights, does not "
            "yet equal one rank there; use 'gpipe', '1f1b' or 'interleaved_1f1b'",
        ),
        (
            {"distributed": {"cp": 2}, "model": {"moe_num_experts": 4}},
            2,
            "model.moe_num_experts: mixture-of-experts blocks (per-rank routing) is not "
            "supported with distributed.cp > 1 yet",
        ),
        (
            {"distributed": {"cp": 2}, "model": {"attention": "flex"}},
            2,
            "model.attention: 'flex' is not supported with distributed.cp > 1 (its gathered "
            "keys run forge's own attention); set 'auto' or 'sdpa'",
        ),
    ],
)
def test_context_parallel_refusals_name_their_key(sections, world, expected):
    assert expected in lines(cfg(**sections), world)


def test_cp_must_be_positive():
    with pytest.raises(ConfigError) as info:
        structure_config({"distributed": {"cp": 0}})
    assert info.value.lines == ["distributed.cp: must be > 0, got 0"]


def test_memory_plan_splits_the_tokens_and_shards_over_cp():
    config = cfg(train={"seq_len": 4096}, model={"max_seq_len": 4096})
    one, two = memory_plan(config, MeshDims()), memory_plan(config, MeshDims(cp=2))
    assert two.parameters == pytest.approx(one.parameters / 2, abs=1)
    assert two.optimizer_state == pytest.approx(one.optimizer_state / 2, abs=1)
    # half the tokens, plus the gathered keys and values of the whole sequence (0.52 here;
    # benchmarks/context_parallel.py measures 0.55 at 4096 tokens); no mask for plain rows
    assert one.activations / 2 < two.activations < 0.55 * one.activations
    packed = cfg(
        train={"seq_len": 4096}, model={"max_seq_len": 4096}, data={"pack_documents": True}
    )
    masks = memory_plan(packed, MeshDims(cp=2)).activations - two.activations
    # per row: (2 cp + 1) boolean squares of a 1024-token chunk
    assert masks == packed.train.batch_size * 5 * 1024 * 1024


def test_the_gathered_keys_and_values_are_a_tensor_parallel_ranks_heads():
    config = cfg(train={"seq_len": 4096}, model={"max_seq_len": 4096})
    alone, with_tp = (context_parallel_bytes(config, 2, tp)[0] for tp in (1, 2))
    assert with_tp == alone // 2
