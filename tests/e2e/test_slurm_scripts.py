"""The sbatch script under fake srun / scontrol: syntax, signal forwarding and requeue."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"

FAKE_SRUN = """#!/bin/bash
# Records its arguments, then behaves like a training job: exit 75 on USR1/TERM, else 0.
echo "$@" > "$SHIM_DIR/srun.args"
trap 'echo USR1 > "$SHIM_DIR/srun.signal"; exit 75' USR1
trap 'echo TERM > "$SHIM_DIR/srun.signal"; exit 75' TERM
touch "$SHIM_DIR/srun.started"
for _ in $(seq 1 {ticks}); do sleep 0.1; done
exit "${FAKE_EXIT:-0}"
"""

FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$SHIM_DIR/scontrol.calls"
"""


def shims(tmp: pathlib.Path, ticks: int) -> dict[str, str]:
    for name, body in (
        ("srun", FAKE_SRUN.replace("{ticks}", str(ticks))),
        ("scontrol", FAKE_SCONTROL),
    ):
        path = tmp / name
        path.write_text(body)
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{tmp}:{os.environ['PATH']}", "SHIM_DIR": str(tmp),
            "SLURM_JOB_ID": "4242", "CONFIG": "configs/train/debug.toml"}  # fmt: skip


def start(tmp: pathlib.Path, ticks: int, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--train.max_steps=10"],
        cwd=REPO, env={**shims(tmp, ticks), **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not (tmp / "srun.started").exists():
        assert time.monotonic() < deadline, "fake srun never started"
        time.sleep(0.05)
    return proc


def test_sbatch_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0


def test_warning_signal_is_forwarded_and_the_job_requeued(tmp_path):
    proc = start(tmp_path, ticks=100)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 75, out
    assert (tmp_path / "srun.signal").read_text().strip() == "USR1"
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "4242"]
    args = (tmp_path / "srun.args").read_text().split()
    assert args[-3:] == ["scripts/train.py", "configs/train/debug.toml", "--train.max_steps=10"]


def test_sigterm_is_forwarded_too(tmp_path):
    proc = start(tmp_path, ticks=100)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == 75
    assert (tmp_path / "srun.signal").read_text().strip() == "TERM"


def test_a_clean_finish_is_not_requeued(tmp_path):
    proc = start(tmp_path, ticks=3)
    proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert not (tmp_path / "scontrol.calls").exists()


def test_a_replay_mismatch_is_not_requeued_onto_the_same_nodes(tmp_path):
    proc = start(tmp_path, ticks=3, FAKE_EXIT="6", SLURM_JOB_NODELIST="gpu[003-004]")
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 6
    assert not (tmp_path / "scontrol.calls").exists()
    assert "not requeued onto suspect hardware" in out and "gpu[003-004]" in out
    assert "--exclude=<host>" in out


def test_the_script_creates_its_log_folder_and_uses_the_venv(tmp_path):
    proc = start(tmp_path, ticks=3)
    proc.communicate(timeout=20)
    assert (REPO / "logs").is_dir()  # --output=logs/%x-%j.out of later submissions lands
    args = (tmp_path / "srun.args").read_text().split()
    python = args[args.index("scripts/train.py") - 1]
    assert python == (".venv/bin/python" if (REPO / ".venv/bin/python").exists() else "python")
