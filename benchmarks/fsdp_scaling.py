"""2-rank FSDP2 step time as a ratio of the 1-rank step time on the same per-rank batch.

A CPU figure (gloo, 2 cores: each rank gets one thread), so it measures the cost of FSDP2's
all-gathers and reduce-scatters on this machine, not GPU scaling::

    python benchmarks/fsdp_scaling.py [--steps 20] [--config configs/train/debug.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from forge.cli import summary

REPO = pathlib.Path(__file__).resolve().parents[1]


def median_step_time(run_dir: pathlib.Path, skip: int) -> float:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in records if "step_time" in r and r["step"] > skip]
    return statistics.median(times)


def run(config: str, run_dir: pathlib.Path, steps: int, ranks: int, threads: int) -> None:
    script = str(REPO / "scripts" / "train.py")
    launcher = [sys.executable, script]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={ranks}", script]  # fmt: skip
    args = [
        config,
        f"--run.dir={run_dir}",
        f"--train.max_steps={steps}",
        "--scheduler.warmup_steps=1",
        "--metrics.log_interval=1",
        "--eval.interval=0",
        "--checkpoint.enabled=false",
        f"--train.num_threads={threads}",
        f"--distributed.dp_shard={ranks}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([*launcher, *args], check=True, env=env, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        run(args.config, root / "one", args.steps, ranks=1, threads=1)
        run(args.config, root / "two", args.steps, ranks=2, threads=1)
        one = median_step_time(root / "one", skip=3)
        two = median_step_time(root / "two", skip=3)
    print("CPU figure: gloo, 1 thread per rank, same per-rank batch, debug model")
    print(f"1 rank:          {one:.3f} s/step")
    print(f"2 ranks (FSDP2): {two:.3f} s/step (twice the tokens per step)")
    print(f"ratio 2-rank / 1-rank step time: {two / one:.2f}")
    print(f"throughput ratio (tokens/s, 2 ranks / 1 rank): {2 * one / two:.2f}")


if __name__ == "__main__":
    main()
