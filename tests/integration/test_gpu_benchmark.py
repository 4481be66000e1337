"""``benchmarks/gpu.py`` without a GPU: its help, its dry run (the 1B and 8B presets built,
validated and planned on the meta device at any sequence length), its parameter-dtype choice,
its averaging and the KempnerForge reference's arithmetic."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from forge.config import Precision
from tests.conftest import REPO


@pytest.fixture(scope="module")
def gpu() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_benchmark", REPO / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_lists_the_options(gpu, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(o in out for o in ("--dry-run", "--seq-len", "--preset", "--param-dtype"))


@pytest.mark.parametrize("seq_len", [4096, 8192, 3000])  # the presets were 8192; any length
def test_the_dry_run_builds_and_validates_both_presets(gpu, capsys, seq_len):
    assert gpu.main(["--dry-run", f"--seq-len={seq_len}"]) == 0
    out = capsys.readouterr().out
    assert "1 x NVIDIA H200; bf16 peak 989 TFLOP/s" in out
    assert f"1b: 1,235,814,400 parameters, 4 x {seq_len} tokens" in out
    assert f"8b: 8,030,261,248 parameters, 2 x {seq_len} tokens" in out
    assert out.count(f"--model.max_seq_len={seq_len}") == 2
    assert "--train.compile=true" in out and "--distributed.dp_shard=1" in out


def test_one_gpu_trains_the_8b_in_bf16_and_eight_keep_fp32_master_weights(gpu, capsys):
    assert gpu.main(["--dry-run", "--preset", "8b"]) == 0
    assert "bf16 weights" in capsys.readouterr().out  # 8B x 16 bytes would not fit one H200
    assert gpu.main(["--dry-run", "--preset", "8b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "fp32 weights" in out and "--distributed.dp_shard=8" in out


def test_a_bad_override_is_refused_in_the_dry_run(gpu, capsys):
    assert gpu.main(["--dry-run", "--batch-size", "-1"]) == 2
    assert "train.batch_size" in capsys.readouterr().err


def test_the_average_never_includes_the_compiling_steps(gpu, capsys):
    assert gpu.main(["--dry-run", "--steps", "5", "--last", "5"]) == 2
    assert "--last" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_so_and_exits_2(gpu, capsys):
    assert gpu.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("requested", "planned", "device", "dtype"),
    [
        ("auto", 20.0, 140.0, Precision.FP32),
        ("auto", 119.0, 140.0, Precision.FP32),  # exactly 85%
        ("auto", 122.0, 140.0, Precision.BF16),  # the 8B on one H200
        ("fp32", 122.0, 140.0, Precision.FP32),  # as asked
        ("bf16", 20.0, 140.0, Precision.BF16),
    ],
)
def test_the_parameter_dtype_choice(gpu, requested, planned, device, dtype):
    assert gpu.choose_param_dtype(requested, planned, device) is dtype


def test_the_kempnerforge_figure_is_its_own_count_of_its_tokens(gpu):
    """10,471 tokens/s of an 8.03B model at seq 4096 on a 989 TFLOP/s H200 is 57.8% when
    every parameter counts (embedding included), 54.5% in forge's count."""
    from forge.config import load_config
    from forge.metrics.flops import flops_per_token

    config = load_config([str(REPO / "configs/train/llama3_8b.toml")]).config
    kempner = gpu.kempner_flops_per_token(config, 4096, 8_030_261_248)
    assert gpu.REFERENCE_TOKENS * kempner / 989e12 == pytest.approx(gpu.REFERENCE_MFU, abs=5e-4)
    forge = gpu.REFERENCE_TOKENS * flops_per_token(config.model, 4096) / 989e12
    assert forge == pytest.approx(0.545, abs=5e-4)


def test_the_last_steps_are_averaged(gpu):
    records = [{"step": s, "loss": 1.0, "tokens_per_sec_per_device": 100.0 * s} for s in range(8)]
    records.insert(3, {"step": 3, "eval/loss": 2.0})  # not a step record
    result = gpu.measured(records, last=3)
    assert result == gpu.Measured(600.0, 500.0, 700.0, (5, 6, 7))
    assert gpu.measured([], last=3) is None
