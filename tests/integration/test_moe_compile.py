"""A mixture-of-experts model under ``train.compile``: every MoE block shares the compiled
graphs, however many there are, and a dropless one traces whole.

A block that read its layer index as a Python int compiled one graph per MoE layer (dynamo
specialises a module's int attributes), and the blocks past dynamo's recompile limit (8)
silently ran eager. Counting each expert's rows with ``bincount`` (whose length depends on
the data) broke the graph in every MoE layer.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from forge.config.sections import ModelConfig
from forge.model.moe import MoE, empty_stats, row_selector, stats_width
from forge.model.vlm import build_model, empty_model
from forge.parallel.parallelize import apply_compile

CFG = ModelConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=259,
    max_seq_len=16,
    moe_num_experts=4,
    moe_top_k=2,
    moe_hidden_dim=32,
)


def compiled_graphs(
    cfg: ModelConfig, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype = torch.bfloat16
) -> tuple[int, int]:
    """How many graphs dynamo compiled, and how many graph breaks it met, for one forward and
    backward of the model forge's ``apply_compile`` compiles (in bf16 by default: the
    grouped-GEMM path, whose graphs do not depend on the routing's counts)."""
    compile_module = nn.Module.compile
    # dynamo's tracing and guards, no C++ compiler: the graph count is dynamo's decision
    monkeypatch.setattr(nn.Module, "compile", lambda m, **kw: compile_module(m, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = build_model(cfg).to(dtype)
    apply_compile(model)
    out = model(torch.randint(0, cfg.vocab_size, (2, 16)), empty_stats(cfg, "cpu"))
    out[0].float().sum().backward()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return graphs, breaks


def test_more_moe_layers_than_dynamos_recompile_limit_compile_no_more_graphs(monkeypatch):
    many = torch._dynamo.config.recompile_limit + 2
    few, _ = compiled_graphs(CFG, monkeypatch)
    assert few > 0
    assert compiled_graphs(attrs.evolve(CFG, n_layers=many), monkeypatch)[0] == few


@pytest.mark.parametrize(
    ("first_dense", "experts", "dtype"),
    [
        (0, 4, torch.bfloat16),  # the grouped GEMM
        (1, 4, torch.bfloat16),
        # no grouped GEMM in fp32 under compile: the buffers, 3 x 32 rows for 2 x 32 (1.5x)
        (0, 3, torch.float32),
    ],
)
def test_a_dropless_moe_model_compiles_without_a_graph_break(
    monkeypatch, first_dense, experts, dtype
):
    """Routing, the sort by expert and the experts trace into the model's graph: no count is
    read on the host (the per-expert loop's split sizes would be a graph break)."""
    cfg = attrs.evolve(CFG, moe_first_dense=first_dense, moe_num_experts=experts)
    graphs, breaks = compiled_graphs(cfg, monkeypatch, dtype)
    assert graphs > 0
    assert breaks == 0


def test_a_model_materialised_from_meta_selects_each_moe_layers_own_row():
    cfg = attrs.evolve(CFG, n_layers=4, moe_first_dense=1)
    model = empty_model(cfg, "cpu", torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert [m.layer for m in layers] == [0, 1, 2]
    for m in layers:
        assert torch.equal(m.stats_row.float(), row_selector(m.layer, 3))


def test_statistics_with_another_number_of_rows_are_refused():
    """A layer adds its row where its selector says: statistics of another shape would be
    broadcast into a wrong one, so they are refused."""
    layer = MoE(CFG, 1)  # CFG's two MoE layers
    with pytest.raises(RuntimeError, match="the MoE statistics need 2 rows"):
        layer(torch.randn(1, 4, CFG.dim), torch.zeros(1, stats_width(CFG.moe_num_experts)))
