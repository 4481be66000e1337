"""Replica groups of two ranks each under FSDP2 (``[fault_tolerance]``), launched as users run
them: one torchrun per group. Opt-in (``FORGE_SLOW_TESTS=1``: four processes on this machine's
two cores take minutes): one rank of group 1 killed, its torchrun ends the group, a new torchrun
relaunches it, and it heals from group 0 — each rank its own shards of the model and of the
optimizer state — then both groups end with the weights of one run of the same global batch.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, TINY
from tests.e2e.test_replica_groups import finished, records, start_lighthouse, weights
from tests.e2e.test_train_script import TRAIN
from tests.in_process import run_main

pytest.importorskip("torchft")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("FORGE_SLOW_TESTS") != "1", reason="opt-in: FORGE_SLOW_TESTS=1 (minutes)"
    ),
]

STEPS = 40
RUN = [f"--train.max_steps={STEPS}", "--data.verify_checksum=false", "--checkpoint.interval=20",
       "--eval.interval=0", "--train.batch_size=2"]  # fmt: skip


def torchrun_group(
    config: pathlib.Path, run_dir: pathlib.Path, group: int, lighthouse: str, faults: str = ""
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "FORGE_FAULTS"}
    if faults:
        env["FORGE_FAULTS"] = faults
    args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(REPO / "scripts" / "train.py"), str(config), f"--run.dir={run_dir}", *RUN,
        "--fault_tolerance.enabled=true", "--fault_tolerance.groups=2",
        f"--fault_tolerance.group={group}", f"--fault_tolerance.lighthouse={lighthouse}",
        "--fault_tolerance.timeout_s=20",
    ]  # fmt: skip
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def test_fsdp_groups_heal_a_relaunched_group_and_train_the_one_run_model(tmp_path, small_corpus):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(data=small_corpus))
    lighthouse, address = start_lighthouse()
    try:
        first = torchrun_group(config, tmp_path / "run", 0, address, "slow:step=1:seconds=0.3")
        doomed = torchrun_group(
            config, tmp_path / "run", 1, address, "signal:step=15:rank=1:sig=KILL"
        )
        code, log = finished(doomed, timeout=300)
        assert code != 0, log[-3000:]
        second = torchrun_group(config, tmp_path / "run", 1, address)
        (code0, log0), (code1, log1) = finished(first, 400), finished(second, 400)
    finally:
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=10)
    assert code0 == 0, log0[-4000:]
    assert code1 == 0, log1[-4000:]
    assert "healed from a live peer at step" in log1
    seen = {s: r["ft/participants"] for s, r in records(tmp_path / "run" / "group_0").items()}
    assert 1 in seen.values() and seen[STEPS] == 2
    out = run_main(
        TRAIN.main,
        [str(config), f"--run.dir={tmp_path / 'ref'}", *RUN, "--train.grad_accum_steps=4"],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reference = weights(config, tmp_path / "ref", STEPS)
    for group in ("group_0", "group_1"):
        trained = weights(config, tmp_path / "run" / group, STEPS)
        for name, tensor in reference.items():
            torch.testing.assert_close(trained[name], tensor, rtol=1e-5, atol=1e-6)
