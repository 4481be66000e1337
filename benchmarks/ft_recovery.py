"""In-job recovery beside restart-from-checkpoint, the same faults: a job of two replica groups
(``[fault_tolerance]``, one process each) whose group 1 is SIGKILLed ``--faults`` times at
steps drawn from ``--seed`` and relaunched at once, against the same job as one launch
(``grad_accum_steps × 2``: the same global batch) SIGKILLed at the same steps and relaunched
from its last checkpoint, as a scheduler would. Each mode is compared with itself
uninterrupted (measured in the same run).

Per fault: the time to recover (the kill to the first step recorded with the job whole again:
both groups taking part; for a restart, the first step past the one it was killed at), the
survivor's stall (the kill to its next step), and the steps computed again (a restart: from its
checkpoint to the step it reached; in-job: the attempts that did not commit). Per mode: the
wall time, its ratio to the same job never interrupted (measured in the same run), and goodput
(that job's wall over this one's)::

    python benchmarks/ft_recovery.py [--faults 3] [--steps 60] [--seed 0] [--data data/stdlib]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import TINY  # noqa: E402  (the tests' tiny model: the same shapes)

SLOW_S = 0.15  # each step's extra compute: a step long enough for a kill to land inside a run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint.interval")
    parser.add_argument("--data", type=pathlib.Path, default=REPO / "data" / "stdlib")
    return parser.parse_args(argv)


def kill_steps(faults: int, steps: int, seed: int) -> list[int]:
    """Distinct steps in the middle of the run, at least 8 apart (a relaunch must rejoin)."""
    rng = random.Random(seed)
    while True:
        picked = sorted(rng.sample(range(8, steps - 12), faults))
        if all(b - a >= 8 for a, b in itertools.pairwise(picked)):
            return picked


class Watch:
    """Records of a run directory read as they appear, each with its arrival time (the file
    is read whole each time: a resume rewrites it)."""

    def __init__(self, run_dir: pathlib.Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.seen: list[tuple[float, dict]] = []
        self._lines: set[str] = set()

    def poll(self) -> None:
        try:
            lines = self.path.read_text().splitlines(keepends=True)
        except OSError:
            return
        for line in lines:
            if not line.endswith("\n") or line in self._lines:
                continue
            self._lines.add(line)
            record = json.loads(line)
            if "loss" in record:
                self.seen.append((time.perf_counter(), record))

    def last_step(self) -> int:
        return self.seen[-1][1]["step"] if self.seen else 0

    def after(self, t: float) -> list[tuple[float, dict]]:
        return [(at, r) for at, r in self.seen if at > t]


def train(config: pathlib.Path, run_dir: pathlib.Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "FORGE_FAULTS": f"slow:step=1:seconds={SLOW_S}"}
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), str(config), f"--run.dir={run_dir}"]
    return subprocess.Popen(
        [*cmd, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
    )


def until(check, timeout: float = 300) -> None:
    end = time.perf_counter() + timeout
    while not check():
        if time.perf_counter() > end:
            raise TimeoutError("the job stopped making progress")
        time.sleep(0.01)


def restart_job(config: pathlib.Path, tmp: pathlib.Path, common: list[str], kills: list[int]):
    """One launch at the same global batch, killed at ``kills`` and relaunched."""
    run_dir = tmp / "restart"
    watch, start, faults = Watch(run_dir), time.perf_counter(), []
    proc = train(config, run_dir, *common, "--train.grad_accum_steps=2")
    for step in kills:
        until(lambda step=step: (watch.poll(), watch.last_step() >= step)[1])
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at, reached = time.perf_counter(), watch.last_step()
        proc = train(config, run_dir, *common, "--train.grad_accum_steps=2")
        until(lambda r=reached: (watch.poll(), watch.last_step() > r)[1])
        resumed = min(r["step"] for _, r in watch.after(killed_at)) - 1
        back = next(at for at, r in watch.after(killed_at) if r["step"] > reached)
        first = watch.after(killed_at)[0][0]
        recover, stall = back - killed_at, first - killed_at
        faults.append({"recover_s": recover, "stall_s": stall, "recomputed": reached - resumed})
    assert proc.wait() == 0, "the restarted job failed"
    return time.perf_counter() - start, faults


def in_job(config: pathlib.Path, tmp: pathlib.Path, common: list[str], kills: list[int], name: str):
    """Two replica groups; group 1 killed at ``kills`` (none: the uninterrupted job) and
    relaunched at once."""
    lighthouse = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "lighthouse.py"), "--port=0",
         "--heartbeat-timeout-ms=1000"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert lighthouse.stdout is not None
    address = lighthouse.stdout.readline().split()[1]
    ft = ["--fault_tolerance.enabled=true", "--fault_tolerance.groups=2",
          f"--fault_tolerance.lighthouse={address}"]  # fmt: skip
    run_dir = tmp / name
    survivor, joiner = Watch(run_dir / "group_0"), Watch(run_dir / "group_1")
    start, faults = time.perf_counter(), []
    try:
        group0 = train(config, run_dir, *common, *ft, "--fault_tolerance.group=0")
        group1 = train(config, run_dir, *common, *ft, "--fault_tolerance.group=1")
        for step in kills:
            until(lambda step=step: (joiner.poll(), joiner.last_step() >= step)[1])
            group1.send_signal(signal.SIGKILL)
            group1.wait()
            killed_at, reached = time.perf_counter(), joiner.last_step()
            group1 = train(config, run_dir, *common, *ft, "--fault_tolerance.group=1")

            def whole(reached: int = reached) -> bool:
                survivor.poll()
                return any(
                    r["step"] > reached and r["ft/participants"] == 2 for _, r in survivor.seen
                )

            until(whole)
            later = [(at, r) for at, r in survivor.seen if r["step"] > reached]
            whole_at = next(i for i, (_, r) in enumerate(later) if r["ft/participants"] == 2)
            until_whole = [r for _, r in later[: whole_at + 1]]
            faults.append(
                {
                    "recover_s": later[whole_at][0] - killed_at,
                    "stall_s": later[0][0] - killed_at,
                    "recomputed": sum(r["ft/failed_attempts"] for r in until_whole),
                    "alone": sum(1 for r in until_whole if r["ft/participants"] == 1),
                }
            )
        assert group0.wait() == 0 and group1.wait() == 0, "a group failed"
    finally:
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait()
    return time.perf_counter() - start, faults


def uninterrupted(config: pathlib.Path, tmp: pathlib.Path, common: list[str]) -> float:
    start = time.perf_counter()
    proc = train(config, tmp / "whole", *common, "--train.grad_accum_steps=2")
    assert proc.wait() == 0
    return time.perf_counter() - start


def row(name: str, wall: float, base: float, faults: list[dict]) -> str:
    recover = [f["recover_s"] for f in faults]
    stall = [f["stall_s"] for f in faults]
    return (
        f"| {name} | {statistics.median(recover):.2f} / {max(recover):.2f} | "
        f"{statistics.median(stall):.2f} | {sum(f['recomputed'] for f in faults)} | "
        f"{wall:.1f} | {wall / base:.2f}× | {base / wall:.2f} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    kills = kill_steps(args.faults, args.steps, args.seed)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        config = tmp / "tiny.toml"
        config.write_text(TINY.format(data=args.data))
        common = [
            f"--train.max_steps={args.steps}",
            f"--checkpoint.interval={args.interval}",
            "--data.verify_checksum=false",
            "--eval.interval=0",
        ]
        base = uninterrupted(config, tmp, common)
        ft_base, _ = in_job(config, tmp, common, [], "in_job_whole")
        restart_wall, restarted = restart_job(config, tmp, common, kills)
        ft_wall, healed = in_job(config, tmp, common, kills, "in_job")
    print(f"kills at steps {kills}; {args.steps} steps, {SLOW_S} s extra each; checkpoint every "
          f"{args.interval}; uninterrupted: {base:.1f} s as one launch, {ft_base:.1f} s as two "
          "replica groups")  # fmt: skip
    print(
        "| mode | time to recover, median / max (s) | stall (s) | steps recomputed | wall (s) "
        "| vs uninterrupted | goodput |"
    )
    print("|---|---|---|---|---|---|---|")
    print(row("restart from checkpoint", restart_wall, base, restarted))
    print(row("in-job (replica groups)", ft_wall, ft_base, healed))
    print(f"in-job: steps the survivor trained alone per fault: {[f['alone'] for f in healed]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
