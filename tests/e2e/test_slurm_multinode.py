"""scripts/slurm/train.sbatch on two nodes, preempted, requeued onto one node with another split.

A stand-in ``srun`` (``tests/e2e/standin_srun.py``) starts 2 nodes × 2 tasks on this machine with
the variables SLURM sets per task; forge binds each task from them (rank, local rank, world
size, the master host from the node list, the port from the job id). The job is sent SIGUSR1
as SLURM does before the time limit: the batch shell forwards it, every rank makes the same
emergency checkpoint and exits 75, and the shell requeues the job (a fake ``scontrol``
records it). The requeued job lands on one node × 2 tasks with another split of the same
global batch, resumes, and continues the uninterrupted run: the same rows every step (row
count and digest, per-source tokens) and its losses within 1e-5.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.test_data_e2e import MIXTURE  # two sources, a phase from step 7
from tests.e2e.test_train_script import TRAIN
from tests.launched import wait_for_line

SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
COMMON = ["--checkpoint.interval=100", "--data.verify_checksum=false",
          "--distributed.timeout_s=60", "--data.pack_documents=true"]  # fmt: skip


def free_slurm_port() -> int:
    """A free port that ``slurm_port`` can derive from a job id: [20000, 40000)."""
    for port in range(31000, 39000, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in [31000, 39000)")


def shims(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir()
    srun = folder / "srun"
    srun.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/e2e/standin_srun.py" "$@"\n')
    scontrol = folder / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{folder}/scontrol.calls"\n')
    for shim in (srun, scontrol):
        shim.chmod(0o755)
    return folder


def job_env(shim_dir, config, job_id: int, nodes: int, per_node: int, nodelist: str, faults=""):
    """What sbatch gives the batch shell for ``--nodes=nodes --ntasks-per-node=per_node``."""
    return {
        **os.environ,
        "PATH": f"{shim_dir}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "CONFIG": str(config),
        "OMP_NUM_THREADS": "1",
        "FORGE_FAULTS": faults,
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_JOB_NODELIST": nodelist,
    }


def logged(run_dir: pathlib.Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record
    return out


@pytest.mark.timeout(600)
def test_two_nodes_preempted_and_requeued_onto_one_node_continue_the_run(
    tiny_config, small_corpus, second_corpus, tmp_path
):
    tiny_config.write_text(
        tiny_config.read_text() + MIXTURE.format(a=small_corpus, b=second_corpus)
    )
    reference = tmp_path / "reference"
    one_rank = ["--train.batch_size=4", "--train.grad_accum_steps=2"]  # 8 rows a step
    assert TRAIN.main([str(tiny_config), f"--run.dir={reference}", *COMMON, *one_rank]) == 0

    shim_dir = shims(tmp_path / "shims")
    job_id = 100000 + free_slurm_port() - 20000  # slurm_port(job id) is that free port
    run = tmp_path / "run"
    two_nodes = job_env(shim_dir, tiny_config, job_id, 2, 2, "127.0.0.[1-2]",
                        faults="stall:step=2:seconds=4")  # fmt: skip
    split = ["--train.batch_size=1", "--train.grad_accum_steps=2"]  # 4 ranks × 1 × 2
    job = subprocess.Popen(
        ["bash", str(SCRIPT), f"--run.dir={run}", *COMMON, *split],
        cwd=REPO, env=two_nodes, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    wait_for_line(job, "step 2 |", timeout_s=180)
    job.send_signal(signal.SIGUSR1)  # SLURM's warning before the time limit
    out, _ = job.communicate(timeout=240)
    assert job.returncode == 75, out
    assert (shim_dir / "scontrol.calls").read_text().split() == ["requeue", str(job_id)]
    saved = json.loads((run / "checkpoints" / "step_3" / "train_state.json").read_text())
    assert (saved["reason"], saved["world_size"]) == ("emergency", 4)

    one_node = job_env(shim_dir, tiny_config, job_id, 1, 2, "127.0.0.1")
    other_split = ["--train.batch_size=4", "--train.grad_accum_steps=1"]  # 2 ranks × 4 × 1
    requeued = subprocess.run(
        ["bash", str(SCRIPT), f"--run.dir={run}", *COMMON, *other_split],
        cwd=REPO, env=one_node, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert requeued.returncode == 0, requeued.stdout[-3000:] + requeued.stderr[-3000:]
    assert "resumed from" in requeued.stderr + requeued.stdout

    ref, got = logged(reference), logged(run)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        for key in (
            "data/rows",
            "data/rows_digest",
            "data/json_email/tokens",
            "data/unittest/tokens",
        ):
            assert got[step][key] == ref[step][key], (step, key)
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-5), (step, key)


def test_a_multi_node_torchrun_that_could_not_restart_is_one_line_and_exit_2(tiny_config, tmp_path):
    """As torchrun's agent starts a worker with --nnodes=2 --max-restarts=2 and its shared
    store: refused before anything is written."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_MAX_RESTARTS": "2"}  # fmt: skip
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), str(tiny_config), f"--run.dir={run}"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lines[0], lines
    assert not run.exists()
