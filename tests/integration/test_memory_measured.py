"""The memory plan (``forge.parallel.memory_plan``, ``scripts/plan.py``) against measurement:
the peak RSS of real runs on a CPU (``memory/peak_rss_gb``, each rank a process of its own
forked from the warm interpreter: its peak starts at the interpreter's resident pages, about
290 MiB, in the run as in its baseline), for a dense model with and without activation
checkpointing (with, beside the rollback snapshot: one launch for both), a mixture of experts
and FSDP2 at 2 ranks. Forked, the ratios are those of fresh processes (measured: 1.00, 1.10,
0.95, 1.07), and the module takes 71 s of two workers instead of 101 s.

What is compared is growth: each run's peak over the peak of the same launch with a tiny model
(imports, threads, the loader: what the plan does not count), against the plan's total (plus
its host snapshot) over the tiny model's. Measured here (2 steps, fp32, dim 512 × 8 layers,
vocab 32000): the plan is 0.97–1.01 of the growth for the dense model, 1.09 with full
activation checkpointing (0.97 with the rollback snapshot alone; both together 1.06), 1.10 for
the mixture of experts and 0.78–0.87 per rank under FSDP2 at 2 ranks, 2 rows a rank, moving
run to run: the plan leaves communication buffers to the device's headroom, and FSDP2's
reduce-scatter input is one more copy of the root's gradients (added to the plan's side here:
``reduce_scatter_input``; with it 0.92–0.97). The tolerance: within 20%.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from forge.config import JobConfig, load_config
from forge.parallel.memory_plan import memory_plan, root_parameters
from forge.parallel.world import MeshDims, resolve_dims
from tests.conftest import once_per_session
from tests.ranks import run_ranks
from tests.zygote import run_script, zygote

REPO = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 0.2
TINY = ["--model.dim=64", "--model.n_layers=1", "--model.n_heads=2", "--train.batch_size=1"]
DENSE = ["--model.dim=512", "--model.n_layers=8", "--model.n_heads=8", "--model.vocab_size=32000"]
MOE = ["--model.dim=384", "--model.n_layers=4", "--model.n_heads=6", "--model.vocab_size=32000",
       "--model.moe_num_experts=8", "--model.moe_top_k=2"]  # fmt: skip
FSDP = ["--distributed.dp_shard=2"]


def launch(
    tmp: pathlib.Path, data: pathlib.Path, args: list[str], ranks: int
) -> tuple[int, int, bool]:
    """(the run's peak RSS on rank 0, the plan's total plus its host snapshot), in bytes, and
    whether its ranks were forked from the warm interpreter."""
    run_dir = tmp / f"run{len(list(tmp.iterdir()))}"
    argv = [str(REPO / "configs" / "train" / "debug.toml"), f"--run.dir={run_dir}",
            f"--data.path={data}", "--train.max_steps=2", "--scheduler.warmup_steps=1",
            "--checkpoint.enabled=false", "--eval.interval=0", "--metrics.log_interval=1",
            "--train.mixed_precision=fp32", "--train.compile=false", "--train.num_threads=1",
            "--resilience.replay_first_step=false", "--data.verify_checksum=false", *args]  # fmt: skip
    config = load_config(argv).config
    dims = resolve_dims(config.distributed, ranks)
    plan = memory_plan(config, dims)
    script = [str(REPO / "scripts" / "train.py"), *argv]
    # forked from the warm interpreter (tests/zygote.py): each rank's peak starts at the
    # interpreter's resident pages, the same in the run and in its baseline, which cancel
    warm = zygote()
    forked = warm is not None and warm.fits(os.environ)
    if ranks > 1:
        out = run_ranks(ranks, script, timeout=600)
    else:
        done = run_script(script, timeout=600)
        out = subprocess.CompletedProcess(script, done.returncode, "", done.stderr.decode())
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    peak = max(r.get("memory/peak_rss_gb", 0.0) for r in records)
    planned = plan.total + plan.snapshot + reduce_scatter_input(config, dims)
    return round(peak * 2**30), planned, forked


def reduce_scatter_input(config: JobConfig, dims: MeshDims) -> int:
    """The communication buffer that moves a sharded run's peak most, which the plan leaves to
    the device's headroom: FSDP2 copies a unit's whole gradients into one reduce-scatter
    input before it frees them, the root's (embedding, head, final norm: the largest unit
    here) last, in fp32. Measured without it at 2 ranks: 0.78-0.87 of the growth, run to run."""
    if dims.dp_shard * dims.cp == 1:
        return 0
    return root_parameters(config.model) * 4 // dims.tp


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, small_corpus):
    """Each layout's tiny-model launch: what every run holds beside what the plan counts
    (once per session: ``once_per_session``)."""
    return once_per_session(
        tmp_path_factory,
        "memory_baselines",
        lambda tmp: {
            1: launch(tmp, small_corpus, TINY, 1),
            2: launch(tmp, small_corpus, TINY + FSDP, 2),
        },
    )


@pytest.mark.parametrize(
    ("args", "ranks"),
    [(DENSE, 1), (MOE, 1), ([*DENSE, *FSDP, "--train.batch_size=2"], 2),
     ([*DENSE, "--train.activation_checkpointing=full", "--resilience.on_nonfinite=rollback",
       "--resilience.snapshot_interval=1"], 1)],
    ids=["dense", "mixture of experts", "fsdp2 at 2 ranks",
         "dense, full activation checkpointing, rollback snapshot"],
)  # fmt: skip
def test_the_plan_is_within_20_percent_of_the_measured_peak(
    baselines, small_corpus, tmp_path, args, ranks
):
    peak, planned, forked = launch(tmp_path, small_corpus, args, ranks)
    base_peak, base_planned, base_forked = baselines[ranks]
    # the baseline may come from the other worker (once_per_session): both forked, or both not
    assert forked == base_forked, "one launch forked from the warm interpreter, one fresh"
    measured, plan = peak - base_peak, planned - base_planned
    assert measured > 500 * 2**20  # the model dominates what is compared
    assert abs(plan / measured - 1) <= TOLERANCE, (plan / 2**20, measured / 2**20)
