"""Replica groups of two ranks each, under FSDP2, tensor parallelism and a pipeline
(``[fault_tolerance]``), launched as users run them: one torchrun per group. Opt-in (``FORGE_SLOW_TESTS=1``: four processes on this machine's
two cores take minutes): group 1's torchrun and ranks killed at once (its node lost), a new
torchrun relaunches it, and it heals from group 0 — each rank its own shards of the model and of the
optimizer state — then both groups end with the weights of one run of the same global batch.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal

import pytest
import torch

from tests.conftest import OPT_IN, REPO, TINY
from tests.e2e.test_replica_groups import (
    asked,
    finished,
    records,
    start_lighthouse,
    stop,
    until_asked,
    until_step,
    weights,
)
from tests.e2e.test_train_script import TRAIN
from tests.in_process import run_main
from tests.launched import Launched, launch

pytest.importorskip("torchft")
pytestmark = list(OPT_IN)

STEPS = 40
RUN = [f"--train.max_steps={STEPS}", "--data.verify_checksum=false", "--checkpoint.interval=20",
       "--eval.interval=0", "--train.batch_size=2"]  # fmt: skip


def torchrun_group(
    config: pathlib.Path,
    run_dir: pathlib.Path,
    group: int,
    lighthouse: str,
    faults: str = "",
    layout: tuple[str, ...] = (),
) -> Launched:
    env = {k: v for k, v in os.environ.items() if k != "FORGE_FAULTS"}
    if faults:
        env["FORGE_FAULTS"] = faults
    args = [
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(REPO / "scripts" / "train.py"), str(config), f"--run.dir={run_dir}", *RUN,
        "--fault_tolerance.enabled=true", "--fault_tolerance.groups=2",
        f"--fault_tolerance.group={group}", f"--fault_tolerance.lighthouse={lighthouse}",
        "--fault_tolerance.timeout_s=20", *layout,
    ]  # fmt: skip
    return launch(args, env, fresh=True)  # torchrun's agent: a fresh interpreter


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (from ``/proc``: torchrun's ranks included)."""
    parents: dict[int, int] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


# (layout inside each group, the one-rank reference's micro-batches for the same global batch)
LAYOUTS = [
    pytest.param(("--distributed.dp_shard=2",), 4, id="fsdp2"),
    pytest.param(("--distributed.dp_shard=1", "--distributed.tp=2"), 2, id="tp2"),
    # a group alone runs its schedule twice a step (its peer's share too)
    pytest.param(
        ("--distributed.dp_shard=1", "--distributed.pp=2", "--train.grad_accum_steps=2"),
        4,
        id="pp2",
    ),
]


@pytest.mark.parametrize("layout,accum", LAYOUTS)
def test_groups_heal_a_relaunched_group_and_train_the_one_run_model(
    tmp_path, small_corpus, layout, accum
):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(data=small_corpus))
    lighthouse, address = start_lighthouse(logs=True)
    run, release = tmp_path / "run", tmp_path / "release"
    try:
        # group 0 waits after step 35 until the relaunched group has asked for a quorum: the
        # heal comes before the run ends, whatever the relaunch's start-up costs
        held = f"stall:step=35:until={release}:seconds=900"  # past until_asked's wait
        first = torchrun_group(config, run, 0, address, held, layout)
        doomed = torchrun_group(config, run, 1, address, "", layout)
        until_step(run / "group_1", 15)
        assert doomed.poll() is None, finished(doomed)[1][-3000:]
        for pid in process_tree(doomed.pid):  # the group's node lost: agent and ranks at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        doomed.finish()
        before = asked(lighthouse, "group_1")
        second = torchrun_group(config, run, 1, address, "", layout)
        until_asked(lighthouse, "group_1", more_than=before, peer=second, timeout=300)
        release.touch()
        (code0, log0), (code1, log1) = finished(first, 400), finished(second, 400)
    finally:
        stop(lighthouse)
    assert code0 == 0, log0[-4000:]
    assert code1 == 0, log1[-4000:]
    assert "healed from a live peer at step" in log1
    seen = {s: r["ft/participants"] for s, r in records(tmp_path / "run" / "group_0").items()}
    assert 1 in seen.values() and seen[STEPS] == 2
    out = run_main(
        TRAIN.main,
        [str(config), f"--run.dir={tmp_path / 'ref'}", *RUN, f"--train.grad_accum_steps={accum}"],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reference = weights(config, tmp_path / "ref", STEPS)
    for group in ("group_0", "group_1"):
        trained = weights(config, tmp_path / "run" / group, STEPS)
        for name, tensor in reference.items():
            torch.testing.assert_close(trained[name], tensor, rtol=1e-5, atol=1e-6)
