"""Sharded initialisation: whatever the world size and layout, the full weights a model
starts from are bit-identical to a one-process build with the same seed (4 real ranks)."""

from __future__ import annotations

import json
import pathlib

import torch

from forge.model.transformer import Transformer
from tests.conftest import REPO
from tests.distributed.init_worker import DENSE, MOE, digests
from tests.ranks import run_ranks


def one_process(cfg) -> dict[str, str]:
    """The reference: the model built on the CPU in one process, no sharding."""
    model = Transformer(cfg)
    model.init_weights(seed=7)
    return digests(model)


def test_every_layout_at_4_and_2_ranks_starts_from_the_one_process_weights(tmp_path: pathlib.Path):
    out = tmp_path / "digests.json"
    worker = str(REPO / "tests" / "distributed" / "init_worker.py")
    run = run_ranks(4, [worker, str(out)], env={"PYTHONPATH": str(REPO)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    layouts = json.loads(out.read_text())
    assert sorted(layouts) == [
        "dense fsdp=2",
        "dense fsdp=2 x tp=2",
        "dense fsdp=4",
        "dense tp=2",
        "moe ep=2",
        "moe fsdp=4",
    ]
    dense, moe = one_process(DENSE), one_process(MOE)
    assert any(".experts." in name for name in moe)  # the MoE case has expert weights
    for layout, got in layouts.items():
        assert got.pop("fallbacks") == "", layout  # every shard computed alone
        assert got == (moe if layout.startswith("moe") else dense), layout


def test_the_weights_differ_with_the_seed():
    a = Transformer(DENSE)
    a.init_weights(seed=7)
    b = Transformer(DENSE)
    b.init_weights(seed=8)
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
