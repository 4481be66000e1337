"""Distributed Muon at 2 real ranks (tests/ranks.py, gloo, CPU, fp32): each rank
orthogonalises only its own matrices, and the steps equal a 1-rank Muon's within 1e-5 and the
gather-everything path's bit for bit.

One launch runs this file as its own worker (``main``), which checks several cases and writes
a summary for the test to read: an FSDP2-sharded toy model whose Muon matrices are 5 (not a
multiple of the world), one with a single row (an empty shard on rank 1), a frozen matrix and
one without a gradient; and ``orthogonalize_all`` on every layout it dispatches (``Shard(0)``,
``Shard(1)`` as TP's rowwise weights, replicated, plain, HSDP's replicate × shard, and two
sharded mesh dims as FSDP2 × TP, which fall back to gathering).
"""

from __future__ import annotations

import json
import pathlib
import sys
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from forge.optim import muon_dist
from forge.optim.optimizers import MuonAdamW
from tests.ranks import run_ranks

REPO = pathlib.Path(__file__).resolve().parents[2]

# Muon matrices of the toy model: index 5 is frozen, index 6 gets no gradient
SHAPES = [(12, 16), (9, 12), (16, 9), (1, 6), (16, 16), (10, 10), (8, 16)]
FROZEN, NO_GRAD = 5, 6
STEPS = 3


def test_distributed_muon_at_two_ranks_equals_one_rank(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "summary.json"
    run = run_ranks(2, [__file__, str(out)], env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    got = json.loads(out.read_text())
    assert got["params_vs_one_rank"] < 1e-5
    assert got["buffers_vs_one_rank"] < 1e-5
    assert got["equal_to_gather_everything"]  # same matrices, same iteration: bit for bit
    assert got["state_keys"] == got["gather_state_keys"]  # checkpoints keep their format
    assert got["group_keys"] == got["gather_group_keys"]
    assert got["no_state_for"] == [FROZEN, NO_GRAD]  # skipped alike on both ranks
    # one step: one all_to_all to the owners, one back; no per-matrix gather
    assert got["all_to_alls_per_step"] == 2
    assert got["gathered_per_step"] == 0
    assert sum(got["iterations_per_rank"]) == 5 and min(got["iterations_per_rank"]) >= 2
    for layout, diff in got["layouts"].items():
        assert diff < 1e-5, layout
    assert all(got["layouts_equal_to_gather_everything"].values())
    assert got["owner_computes"] == {
        "shard0 (fsdp2, colwise)": True,
        "shard1 (rowwise tp)": True,
        "one row (empty shard)": True,
        "replicated": False,
        "hsdp (replicate x shard)": True,
        "fsdp2 x tp (gathers)": False,
        "plain tensor": False,
    }


class Toy(nn.Module):
    """Muon matrices of ``SHAPES`` and one vector for the AdamW part."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.mats = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])
        self.mats[FROZEN].requires_grad_(False)
        self.norm = nn.Parameter(torch.ones(7))


def optimizer(model: Toy, **kwargs: bool) -> MuonAdamW:
    """Muon over every matrix (the frozen one included: it has no gradient), AdamW for the
    vector."""
    groups = [
        {"params": list(model.mats), "use_muon": True, "weight_decay": 0.1},
        {"params": [model.norm]},
    ]
    return MuonAdamW(groups, lr=0.02, **kwargs)


def grads(step: int) -> list[torch.Tensor | None]:
    """The same full gradients on every rank: one per matrix (none for the frozen and the
    unused one), then the vector's."""
    g = torch.Generator().manual_seed(100 + step)
    full = [torch.randn(s, generator=g) for s in SHAPES] + [torch.randn(7, generator=g)]
    return [None if i in (FROZEN, NO_GRAD) else t for i, t in enumerate(full)]


def set_grads(model: Toy, step: int) -> None:
    """Each parameter's gradient in its own layout (a shard of the full one under FSDP2)."""
    for p, grad in zip([*model.mats, model.norm], grads(step), strict=True):
        if grad is None:
            p.grad = None
        elif isinstance(p, DTensor):
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = grad


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def trained(mesh: DeviceMesh | None, **kwargs: bool) -> tuple[Toy, MuonAdamW]:
    """The toy model after ``STEPS`` steps, FSDP2-sharded over ``mesh`` (None: one rank)."""
    model = Toy()
    if mesh is not None:
        fully_shard(model, mesh=mesh)
    opt = optimizer(model, **kwargs)
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
    return model, opt


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((full(x) - full(y)).abs().max()) for x, y in zip(a, b, strict=True))


def optimizer_checks(mesh: DeviceMesh) -> dict:
    """The sharded toy model against one rank and against the gather-everything path."""
    ref, ref_opt = trained(None)
    ours, opt = trained(mesh)
    theirs, gather_opt = trained(mesh, distributed_ns=False)
    bufs = [opt.state[p]["momentum_buffer"] for p in ours.mats if p in opt.state]
    ref_bufs = [ref_opt.state[p]["momentum_buffer"] for p in ref.mats if p in ref_opt.state]
    state, gather_state = opt.state_dict(), gather_opt.state_dict()
    return {
        "params_vs_one_rank": max_diff(list(ours.parameters()), list(ref.parameters())),
        "buffers_vs_one_rank": max_diff(bufs, ref_bufs),
        "equal_to_gather_everything": all(
            torch.equal(full(a), full(b))
            for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        ),
        "state_keys": {str(k): sorted(v) for k, v in state["state"].items()},
        "gather_state_keys": {str(k): sorted(v) for k, v in gather_state["state"].items()},
        "group_keys": [sorted(g) for g in state["param_groups"]],
        "gather_group_keys": [sorted(g) for g in gather_state["param_groups"]],
        "no_state_for": [i for i, p in enumerate(ours.mats) if p not in opt.state],
        **communication(ours, opt),
    }


def communication(model: Toy, opt: MuonAdamW) -> dict:
    """The collectives and Newton–Schulz iterations of one more step on this rank."""
    set_grads(model, STEPS)
    a2a = mock.patch.object(dist, "all_to_all_single", wraps=dist.all_to_all_single)
    gathered = mock.patch.object(muon_dist, "orthogonalized", wraps=muon_dist.orthogonalized)
    ns = mock.patch.object(muon_dist, "newton_schulz", wraps=muon_dist.newton_schulz)
    with a2a as a2a_calls, gathered as gathered_calls, ns as ns_calls:
        opt.step()
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, ns_calls.call_count)
    return {
        "all_to_alls_per_step": a2a_calls.call_count,
        "gathered_per_step": gathered_calls.call_count,
        "iterations_per_rank": counts,
    }


def layout_checks(mesh: DeviceMesh) -> dict:
    """``orthogonalize_all`` on each layout it dispatches against ``newton_schulz`` of the
    full matrix (and the gather-everything path)."""
    grid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("outer", "inner"))
    g = torch.Generator().manual_seed(7)
    cases = {
        "shard0 (fsdp2, colwise)": (torch.randn(7, 5, generator=g), mesh, [Shard(0)]),
        "shard1 (rowwise tp)": (torch.randn(6, 9, generator=g), mesh, [Shard(1)]),
        "one row (empty shard)": (torch.randn(1, 4, generator=g), mesh, [Shard(0)]),
        "replicated": (torch.randn(4, 4, generator=g), mesh, [Replicate()]),
        "hsdp (replicate x shard)": (torch.randn(5, 6, generator=g), grid, [Replicate(), Shard(0)]),
        "fsdp2 x tp (gathers)": (torch.randn(3, 8, generator=g), grid, [Shard(0), Shard(1)]),
        "plain tensor": (torch.randn(5, 3, generator=g), None, None),
    }
    updates = [
        m if mesh_ is None else distribute_tensor(m, mesh_, pl, src_data_rank=None)
        for m, mesh_, pl in cases.values()
    ]
    steps = [5] * len(updates)
    ours = muon_dist.orthogonalize_all(updates, steps)
    theirs = muon_dist.orthogonalize_all(updates, steps, distributed=False)
    expected = [muon_dist.newton_schulz(m, 5) for m, _, _ in cases.values()]
    return {
        "owner_computes": {
            name: muon_dist.sharding_mesh(u) is not None
            for name, u in zip(cases, updates, strict=True)
        },
        "layouts": {
            name: float((full(o) - e).abs().max())
            for name, o, e in zip(cases, ours, expected, strict=True)
        },
        "layouts_equal_to_gather_everything": {
            name: torch.equal(full(o), full(t))
            for name, o, t in zip(cases, ours, theirs, strict=True)
        },
    }


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    summary = {**optimizer_checks(mesh), **layout_checks(mesh)}
    if dist.get_rank() == 0:
        pathlib.Path(sys.argv[1]).write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
