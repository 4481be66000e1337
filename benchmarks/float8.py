"""FP8 and its drift guard in forge's own loop: what the guard costs, against the same FP8 run
without it, and what FP8 costs here against high precision.

Three runs of ``scripts/train.py`` on the debug config (dim 256, 4 layers, 256 tokens a row,
fp32 compute, one thread), each ``--steps`` steps: without FP8, with ``train.float8`` (rowwise),
and with it checked every ``--check`` steps (``train.float8_check``). Each run's mean step time
(``metrics.jsonl``'s ``step_time``, every step logged, the first ``--warmup`` left out) over
``--rounds`` rounds in rotating order; medians of the rounds compared. The guard's cost is
checked / unchecked FP8: one more high-precision forward and backward every ``--check``
steps, so about ``1 + (high-precision step / FP8 step) / check``, printed beside it. On a CPU
FP8 runs in torchao's emulation (casts and scales in fp32, products in high precision): its
ratio against high precision is the emulation's overhead, not FP8's speed (that is for
``benchmarks/gpu_check.sh`` on a GPU)::

    python benchmarks/float8.py [--steps 40] [--check 10] [--warmup 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: forge from this checkout

from forge.cli import summary  # noqa: E402
from forge.training.setup.problems import cpu_flags  # noqa: E402

RUN_LIMIT_S = 1800.0


def run_args(steps: int, check: int) -> dict[str, list[str]]:
    """Each variant's overrides of the debug config."""
    fp8 = ["--train.float8=rowwise"]
    return {
        "high precision": [],
        "fp8": fp8,
        f"fp8, checked every {check}": [*fp8, f"--train.float8_check={check}"],
    }


def mean_step_time(run_dir: pathlib.Path, warmup: int) -> tuple[float, int]:
    """The mean ``step_time`` past the first ``warmup`` steps, and how many steps it spans."""
    times = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step_time" in record and record["step"] > warmup:
            times.append(record["step_time"])
    return statistics.fmean(times), len(times)


def train(data: str, run_dir: pathlib.Path, steps: int, extra: list[str]) -> None:
    cmd = [
        sys.executable, str(REPO / "scripts" / "train.py"), str(REPO / "configs/train/debug.toml"),
        f"--run.dir={run_dir}", f"--data.path={data}", f"--train.max_steps={steps}",
        "--train.mixed_precision=fp32", "--train.num_threads=1", "--metrics.log_interval=1",
        "--checkpoint.enabled=false", f"--eval.interval={steps}", "--eval.steps=1",
        f"--scheduler.warmup_steps={min(10, steps - 1)}", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=RUN_LIMIT_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--check", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))
    args = parser.parse_args()
    flags = cpu_flags()
    bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    print(f"# {platform.processor() or platform.machine()}; AVX-512 BF16/AMX: {bf16}")
    variants = run_args(args.steps, args.check)
    means: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            names = list(variants)
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                run_dir = pathlib.Path(tmp) / f"{r}-{len(means[name])}-{name.split(',')[0]}"
                train(args.data, run_dir, args.steps, variants[name])
                mean, n = mean_step_time(run_dir, args.warmup)
                means[name].append(mean)
                print(f"round {r + 1}: {name:<24} mean step {mean * 1e3:8.1f} ms over {n} steps")
    medians = {name: statistics.median(values) for name, values in means.items()}
    hp, fp8, checked = (medians[name] for name in variants)
    print(f"{'variant':<26}{'step (ms)':>12}{'ratio':>9}")
    for name, value in medians.items():
        print(f"{name:<26}{value * 1e3:>12.1f}{value / fp8:>9.3f}")
    expected = 1 + (hp / fp8) / args.check
    every = f"one more high-precision step every {args.check}"
    print(f"guard: checked / unchecked FP8 = {checked / fp8:.3f} ({every}: {expected:.3f})")
    print(f"emulated FP8 / high precision = {fp8 / hp:.3f} (torchao's emulation on a CPU)")


if __name__ == "__main__":
    main()
