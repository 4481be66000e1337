"""FP8 and the deterministic mode in whole runs of the tiny config (one rank, in this process;
CPU, so FP8 runs in torchao's emulation).

- ``train.float8`` trains within a stated tolerance of the same run without it (measured: a
  3-step loss within 1.8e-4, relative, with either recipe; allowed: 1e-3), its checkpoints hold the same tensors by name
  and dtype, and a resume from FP8 into a run without it (and back) is a numerics change:
  allowed, named in one warning.
- ``train.deterministic`` on a CPU changes no bit (two launches equal each other and a launch
  without it), and leaves torch's kernel settings as they were once ``main`` returns.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.distributed.test_equivalence import (
    COMMON,
    TRAIN,
    records,
    train,
    weights,
    write_config,
)
from tests.in_process import run_main

pytest.importorskip("torchao")  # the fp8 extra, in dev: runs in `make test`

STEPS = ["--train.max_steps=3", "--checkpoint.interval=3", "--eval.interval=3"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_run_trains_within_tolerance_of_the_run_without_it(tmp_path, small_corpus, recipe):
    config = write_config(tmp_path, small_corpus)
    train(config, tmp_path / "plain", *STEPS)
    train(config, tmp_path / "fp8", *STEPS, f"--train.float8={recipe}")
    plain, fp8 = records(tmp_path / "plain"), records(tmp_path / "fp8")
    assert [r["step"] for r in fp8] == [1, 2, 3]
    for a, b in zip(plain, fp8, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert b["loss"] != a["loss"]  # FP8 did run
    ref, got = weights(config, tmp_path / "plain", 3), weights(config, tmp_path / "fp8", 3)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in ref.items()}


def test_fp8_and_high_precision_resume_into_each_other_with_a_named_warning(tmp_path, small_corpus):
    config = write_config(tmp_path, small_corpus)
    run = tmp_path / "run"
    train(config, run, "--train.max_steps=4", "--checkpoint.interval=2", "--eval.interval=4",
          "--train.float8=tensorwise")  # fmt: skip
    shutil.rmtree(run / "checkpoints" / "step_4")  # back to step 2: resume it without FP8
    out = run_main(TRAIN.main, [str(config), f"--run.dir={run}", *COMMON, "--train.max_steps=4",
                                "--checkpoint.interval=2", "--eval.interval=4",
                                "--checkpoint.allow_rewind=true"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "train.float8: 'tensorwise' → 'off'" in out.stderr
    assert [r["step"] for r in records(run)][-2:] == [3, 4]


def deterministic_state() -> tuple[bool, bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )


def test_the_deterministic_mode_changes_no_bit_on_a_cpu_and_is_put_back(tmp_path, small_corpus):
    config = write_config(tmp_path, small_corpus)
    before = deterministic_state()
    said = "[forge] deterministic: every operation runs a deterministic kernel, or torch names it"
    for name in ("a", "b"):
        out = train(config, tmp_path / name, *STEPS, "--train.deterministic=true")
        assert deterministic_state() == before  # main put torch's settings back
        assert f"{said} (a CPU's kernels already are: no bit changes)" in out.stderr
    assert said not in train(config, tmp_path / "without", *STEPS).stderr
    a, b, without = (records(tmp_path / n) for n in ("a", "b", "without"))
    losses = [[r["loss"] for r in run] for run in (a, b, without)]
    assert losses[0] == losses[1] == losses[2]
    wa, wb = weights(config, tmp_path / "a", 3), weights(config, tmp_path / "without", 3)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


BLOCK_TORCHAO = (
    "import runpy, sys; sys.modules['torchao'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_an_fp8_runs_checkpoint_exports_and_generates_without_torchao(tmp_path, small_corpus):
    """The scripts that read an FP8 run's checkpoint import no torchao: run here with its
    import made to fail."""
    import subprocess
    import sys

    from tests.conftest import REPO

    config = write_config(tmp_path, small_corpus)
    train(config, tmp_path / "fp8", *STEPS, "--train.float8=rowwise")
    scripts = REPO / "scripts"
    for argv in (
        [scripts / "convert_checkpoint.py", "export", tmp_path / "fp8", "--out", tmp_path / "hf"],
        [scripts / "generate.py", tmp_path / "fp8", "--prompt", "def ", "--max-new-tokens", "4"],
    ):
        out = subprocess.run([sys.executable, "-c", BLOCK_TORCHAO, *map(str, argv)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()
