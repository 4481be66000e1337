"""benchmarks/gpu_check.sh, the one GPU acceptance command: its CUDA tests are collected here
and skipped with their reason, every row of its benchmark table is validated and planned
(a dry run: no config meets the GPU for the first time), and the script says it needs a GPU
(exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_without_a_gpu_the_check_skips_every_cuda_test_with_its_reason(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                          timeout=240, env=env, check=False)  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    log = (tmp_path / "cuda_tests.log").read_text()
    skipped = [line for line in log.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("needs a CUDA device" in line for line in skipped), log[-2000:]
    count = sum(int(line.split("[")[1].split("]")[0]) for line in skipped)
    assert count >= 1 and f"{count} skipped" in log  # every CUDA test collected, none run
    assert " passed" not in log and " failed" not in log
    assert "no CUDA device here" in done.stderr.splitlines()[-1]
    machine = (tmp_path / "machine.txt").read_text()
    assert f"torch {torch.__version__} " in machine and "gpus 0" in machine
    # the rehearsal: every row of the table validated and planned, none run
    table = (tmp_path / "table.txt").read_text().splitlines()
    rows = [line.split()[:3] for line in table[1:]]
    assert [r[:2] for r in rows] == [["1b", "bf16"], ["1b", "fp8"], ["8b", "bf16"], ["8b", "fp8"],
                                     ["1b", "fp8-checked"], ["1b", "deterministic"]]  # fmt: skip
    assert all(r[2] == "dry-run" for r in rows), table


def test_a_python_without_forges_dependencies_is_named_and_nothing_runs(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    python.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": str(python)}, check=False)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "lacks forge's dependencies" in done.stderr and "No module named torch" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == []  # no stage ran
