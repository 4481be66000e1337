"""The trainer never waits: training with the follower evaluating beside it, against in-loop.

A training run with ``scripts/eval_follow.py`` evaluating beside it, against the same run
evaluating in its loop. Both train the debug config (dim 256, 4 layers, 256 tokens a row,
fp32) for ``--steps`` steps with a checkpoint every ``--interval`` steps and the held-out loss
over ``--eval-steps`` batches at the same steps; one thread per process, each process pinned
to a core of its own: the trainer on the first core in both runs, the follower on the second.
The in-loop run (``eval.interval``) stops training while it evaluates; the other
(``eval.follow = true``) evaluates nothing itself, and the follower evaluates each committed
checkpoint of those steps. Rounds alternate the two runs' order (ABBA); medians are compared.

Reported per run: the trainer's wall time (process start to exit), its step time (mean and
median of ``metrics.jsonl``'s ``step_time``, the first ``--warmup`` steps left out; the loop
times steps only, so an in-loop evaluation is not in them), the seconds its goodput ledger
puts in ``evaluation``; for the follower, its lag (its last record's write after the trainer's
final commit) and the largest difference between its ``eval/loss`` and the in-loop run's at
each step (bit-identical: 0), and the CPU time other processes took meanwhile (noise). Then
follower-beside / in-loop for wall and step time. A matmul probe first tells whether the two
cores share their vector units (hyperthreads of one core, which a VM may not show)::

    python benchmarks/eval_follow.py [--steps 120] [--interval 20] [--eval-steps 20] \\
        [--rounds 2] [--poll-s 1] [--data data/stdlib] [--out eval_follow.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import attrs

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: forge from this checkout

from forge.cli import summary  # noqa: E402
from forge.errors import print_errors  # noqa: E402
from forge.metrics.goodput import Bucket, read_ledger, run_totals  # noqa: E402
from forge.outputs import file_output_problem, replace_file  # noqa: E402
from forge.training.setup.problems import cpu_flags  # noqa: E402

RUN_LIMIT_S = 900.0  # seconds a trainer (or its follower after it) may take before it is killed
STEP_TIME_TARGET = 1.03  # follower-beside / in-loop step time: a core of its own, no slowdown
NOISE_SHARE = 0.05  # other processes' CPU time, as a share of a run's wall, that makes it noisy
CONTENTION_LIMIT = 1.1  # the matmul probe's ratio above which the cores are not independent
MODES = ("in-loop", "follower")


@attrs.frozen
class Measured:
    """One run's figures."""

    mode: str
    wall_s: float  # the trainer, process start to exit
    step_mean_s: float
    step_median_s: float
    steps_timed: int
    step_max_s: float  # the slowest timed step
    evaluation_s: float  # the ledger's evaluation bucket (0 with the follower beside)
    checkpoint_s: float  # the ledger's checkpoint bucket (both runs save the same steps)
    losses: dict[int, float]  # eval/loss by step: the loop's, or the follower's records
    skipped: int = 0  # follower steps recorded as skipped (retention was first)
    lag_s: float = math.nan  # the follower's last record after the trainer's final commit
    follower_wall_s: float = math.nan  # the follower, process start to exit
    follower_after_trainer_s: float = math.nan  # its exit after the trainer's
    others_cpu_s: float = math.nan  # CPU time of processes not this benchmark's, during it


def config_args(data: pathlib.Path, args: argparse.Namespace, follow: bool) -> list[str]:
    """The run: the debug config, a checkpoint and an evaluation every ``--interval`` steps,
    every step logged (its own ``step_time``)."""
    return [
        str(REPO / "configs" / "train" / "debug.toml"),
        f"--data.path={data}",
        f"--train.max_steps={args.steps}",
        "--scheduler.warmup_steps=10",
        f"--eval.interval={args.interval}",
        f"--eval.steps={args.eval_steps}",
        f"--eval.follow={str(follow).lower()}",
        f"--checkpoint.interval={args.interval}",
        "--metrics.log_interval=1",
        "--data.verify_checksum=false",
    ]


def busy_s() -> tuple[float, float]:
    """(the machine's busy CPU seconds, this process's children's CPU seconds) so far."""
    try:
        fields = pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    except OSError:
        return math.nan, math.nan
    ticks = [int(f) for f in fields]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, children.ru_utime + children.ru_stime


def pinned_to(core: int):
    """A ``preexec_fn``: the child runs on ``core`` alone."""
    return lambda: os.sched_setaffinity(0, {core})


def start(cmd: list[str], core: int, log: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with log.open("ab") as out:
        return subprocess.Popen(  # one thread here: preexec_fn is safe
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=pinned_to(core)
        )


def finish(proc: subprocess.Popen, began: float, what: str, log: pathlib.Path) -> float:
    """Wait for ``proc`` (killed past ``RUN_LIMIT_S`` from ``began``); its exit time."""
    try:
        proc.wait(timeout=max(1.0, RUN_LIMIT_S - (time.monotonic() - began)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{what} ran past {RUN_LIMIT_S:g} s; see {log}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}; see {log}")
    return time.monotonic()


def json_records(path: pathlib.Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def run_once(
    work: pathlib.Path, mode: str, args: argparse.Namespace, cores: tuple[int, int]
) -> Measured:
    """One run (a fresh run directory), the follower beside it in ``follower`` mode."""
    run_dir = work / f"{mode}-{len(list(work.glob(f'{mode}-*')))}"
    follow = mode == "follower"
    train = [sys.executable, str(REPO / "scripts" / "train.py"),
             *config_args(args.data, args, follow), f"--run.dir={run_dir}"]  # fmt: skip
    log = pathlib.Path(f"{run_dir}.log")
    before = busy_s()
    began = time.monotonic()
    trainer = start(train, cores[0], log)
    follower = None
    if follow:
        evaluate = [sys.executable, str(REPO / "scripts" / "eval_follow.py"), str(run_dir),
                    f"--poll-s={args.poll_s}", "--device=cpu"]  # fmt: skip
        follower = start(evaluate, cores[1], pathlib.Path(f"{run_dir}.follower.log"))
    trainer_end = finish(trainer, began, f"the {mode} trainer", log)
    follower_end = math.nan
    if follower is not None:
        follower_log = pathlib.Path(f"{run_dir}.follower.log")
        follower_end = finish(follower, began, "the follower", follower_log)
    after = busy_s()
    others = (after[0] - before[0]) - (after[1] - before[1])
    measured = measure(run_dir, mode, args.warmup, trainer_end - began, follower_end - began)
    return attrs.evolve(measured, others_cpu_s=max(0.0, others))


def measure(
    run_dir: pathlib.Path, mode: str, warmup: int, wall: float, follower_wall: float
) -> Measured:
    """The figures of a finished run directory."""
    records = json_records(run_dir / "metrics.jsonl")
    times = [r["step_time"] for r in records if "step_time" in r and r["step"] > warmup]
    totals = run_totals(read_ledger(run_dir / "goodput.jsonl"))
    base = Measured(
        mode,
        wall,
        statistics.mean(times),
        statistics.median(times),
        len(times),
        max(times),
        totals.get(Bucket.EVALUATION, 0.0),
        totals.get(Bucket.CHECKPOINT, 0.0),
        {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r},
    )
    if mode != "follower":
        return base
    results = run_dir / "eval_follow.jsonl"
    follower = [r for r in json_records(results) if r.get("what") == "loss"]
    commit = (run_dir / "checkpoints.jsonl").stat().st_mtime
    return attrs.evolve(
        base,
        losses={r["step"]: r["eval/loss"] for r in follower if "eval/loss" in r},
        skipped=sum("skipped" in r for r in follower),
        lag_s=results.stat().st_mtime - commit,
        follower_wall_s=follower_wall,
        follower_after_trainer_s=follower_wall - wall,
    )


def largest_difference(a: dict[int, float], b: dict[int, float]) -> tuple[float, int, list]:
    """The largest |a - b| over the steps both hold, their count, the steps one lacks."""
    both = sorted(a.keys() & b.keys())
    diff = max((abs(a[s] - b[s]) for s in both), default=math.nan)
    return diff, len(both), sorted(a.keys() ^ b.keys())


def machine_line(cores: tuple[int, int]) -> str:
    flags = cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    name = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    import torch

    return (
        f"cpu: {name or platform.processor() or platform.machine()}, flags: "
        f"{', '.join(shown) or 'none of avx2/avx512'}; torch {torch.__version__}, capability "
        f"{torch.backends.cpu.get_cpu_capability()}; {os.cpu_count()} cores, trainer on core "
        f"{cores[0]}, follower on core {cores[1]}, 1 thread each, fp32; load average "
        f"{os.getloadavg()[0]:.2f} at the start"
    )


def siblings(cores: tuple[int, int]) -> bool:
    """Whether the two cores are SMT siblings (one physical core: they would contend)."""
    path = pathlib.Path(f"/sys/devices/system/cpu/cpu{cores[0]}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return False
    listed: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        listed |= set(range(int(lo), int(hi or lo) + 1))
    return cores[1] in listed


def median_of(runs: Sequence[Measured], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def finite_or_none(record: dict) -> dict:
    """``record`` with NaN (a figure the run has not: the in-loop run's follower) as None."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}


def report_of(runs: Sequence[Measured], args: argparse.Namespace) -> dict[str, object]:
    """The medians, the ratios and the follower's agreement with the loop."""
    by = {m: [r for r in runs if r.mode == m] for m in MODES}
    loop, beside = by["in-loop"], by["follower"]
    diffs = [largest_difference(f.losses, i.losses) for f, i in zip(beside, loop, strict=True)]
    fields = ("wall_s", "step_mean_s", "step_median_s", "evaluation_s", "checkpoint_s")
    medians = {mode: {f: round(median_of(by[mode], f), 4) for f in fields} for mode in MODES}
    for f in ("lag_s", "follower_wall_s", "follower_after_trainer_s"):
        medians["follower"][f] = round(median_of(beside, f), 3)
    medians["follower"]["skipped"] = sum(r.skipped for r in beside)
    step_ratio = median_of(beside, "step_median_s") / median_of(loop, "step_median_s")
    return {
        "steps": args.steps,
        "interval": args.interval,
        "eval_steps": args.eval_steps,
        "rounds": args.rounds,
        "poll_s": args.poll_s,
        "runs": [
            finite_or_none(attrs.asdict(r, filter=lambda a, _: a.name != "losses")) for r in runs
        ],
        "median": medians,
        "ratio_wall": round(medians["follower"]["wall_s"] / medians["in-loop"]["wall_s"], 3),
        "ratio_step_median": round(step_ratio, 3),
        "ratio_step_mean": round(
            median_of(beside, "step_mean_s") / median_of(loop, "step_mean_s"), 3
        ),
        "eval_loss_max_abs_diff": max(d[0] for d in diffs),
        "eval_loss_steps_compared": [d[1] for d in diffs],
        "eval_loss_steps_unmatched": [d[2] for d in diffs],
    }


def print_report(report: dict, runs: Sequence[Measured], note: str | None) -> None:
    for r in runs:
        extra = ""
        if r.mode == "follower":
            extra = (f" | follower: lag {r.lag_s:.2f} s after the final commit, wall "
                     f"{r.follower_wall_s:.1f} s, {len(r.losses)} steps evaluated, "
                     f"{r.skipped} skipped")  # fmt: skip
        print(
            f"{r.mode:>8}: trainer wall {r.wall_s:6.1f} s | step mean {r.step_mean_s * 1e3:6.1f}"
            f" ms, median {r.step_median_s * 1e3:6.1f} ms, max {r.step_max_s * 1e3:6.1f} ms "
            f"({r.steps_timed} steps) | evaluation "
            f"{r.evaluation_s:5.2f} s, checkpoint {r.checkpoint_s:4.2f} s | other processes "
            f"{r.others_cpu_s:.1f} CPU-s{extra}"
        )
    noisy = [r for r in runs if r.others_cpu_s > NOISE_SHARE * r.wall_s]
    if noisy:
        worst = max(r.others_cpu_s / r.wall_s for r in noisy)
        print(
            f"warning: other processes took up to {worst:.0%} of a core during {len(noisy)} "
            "run(s): the figures are noisy; re-run on a quiet machine"
        )
    med = report["median"]
    print()
    loop, beside = med["in-loop"], med["follower"]
    print(
        f"medians over {report['rounds']} round(s): in-loop wall {loop['wall_s']:.1f} s "
        f"(evaluation {loop['evaluation_s']:.2f} s, "
        f"{loop['evaluation_s'] / loop['wall_s']:.1%} of it), follower beside "
        f"{beside['wall_s']:.1f} s (evaluation {beside['evaluation_s']:.2f} s)"
    )
    print(
        f"step time, in-loop / follower beside: median {loop['step_median_s'] * 1e3:.1f} / "
        f"{beside['step_median_s'] * 1e3:.1f} ms, mean {loop['step_mean_s'] * 1e3:.1f} / "
        f"{beside['step_mean_s'] * 1e3:.1f} ms"
    )
    print(
        f"follower: last record {beside['lag_s']:.2f} s after the trainer's final commit "
        f"(polling every {report['poll_s']:g} s), exits {beside['follower_after_trainer_s']:.2f}"
        f" s after the trainer; {beside['skipped']} step(s) skipped"
    )
    compared = report["eval_loss_steps_compared"]
    unmatched = [s for u in report["eval_loss_steps_unmatched"] for s in u]
    print(
        f"eval/loss, follower against in-loop: max abs difference "
        f"{report['eval_loss_max_abs_diff']!r} over {compared} step(s)"
        + (f"; steps only one side has: {unmatched}" if unmatched else "")
    )
    print(f"ratio follower beside / in-loop, wall time: {report['ratio_wall']:.3f}")
    verdict = "meets" if report["ratio_step_median"] <= STEP_TIME_TARGET else "MISSES"
    if note:
        verdict = f"target skipped: {note}"
    print(
        f"ratio follower beside / in-loop, step time: median {report['ratio_step_median']:.3f},"
        f" mean {report['ratio_step_mean']:.3f} ({verdict} target <= {STEP_TIME_TARGET})"
    )


def is_report(path: pathlib.Path) -> bool:
    """Whether ``path`` holds a report this script wrote (it may be written over)."""
    try:
        return "eval_loss_max_abs_diff" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def out_problem(out: pathlib.Path | None) -> str | None:
    """Why ``--out`` may not be written (forge's rule for a script's one file), or None."""
    return None if out is None else file_output_problem(out, "--out", "eval_follow", is_report)


def work_problem(work: pathlib.Path | None) -> str | None:
    """The runs go in ``--work``: a folder of its own, absent or empty (a run already there
    would be resumed, and the figures with it)."""
    if work is None or not work.exists():
        return None
    if not work.is_dir() or any(work.iterdir()):
        return f"--work {work}: exists and is not an empty folder; name a new one"
    return None


def option_problems(args: argparse.Namespace) -> list[str]:
    lines = [p for p in (out_problem(args.out), work_problem(args.work)) if p]
    if args.interval < 1 or args.steps < args.interval or args.steps % args.interval:
        lines.append(f"--steps {args.steps}: must be a multiple of --interval {args.interval}")
    if args.steps <= 10:
        lines.append(f"--steps {args.steps}: must be > 10 (the schedule's warm-up)")
    if args.eval_steps < 1 or args.rounds < 1 or args.warmup < 0 or not args.poll_s > 0:
        lines.append("--eval-steps and --rounds must be >= 1, --warmup >= 0, --poll-s > 0")
    if not (args.data / "manifest.json").is_file():
        lines.append(
            f"--data {args.data}: no prepared dataset; run "
            f"`python scripts/prepare_data.py --out {args.data}`"
        )
    return lines


def cores_of() -> tuple[tuple[int, int] | None, str | None]:
    """The two cores (the trainer's, the follower's), and why the step-time target does not
    apply here (None when it does)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None, f"one core ({allowed}): the follower needs a core of its own"
    cores = (allowed[0], allowed[1])
    if siblings(cores):
        return cores, f"cores {cores} are SMT siblings of one physical core"
    return cores, None


PROBE = """
import sys, time, torch
torch.set_num_threads(1)
x, w = torch.randn(1024, 256), torch.randn(256, 704)  # a micro-batch through an MLP matrix
for _ in range(20):
    x @ w
n, start = 0, time.perf_counter()
while time.perf_counter() - start < float(sys.argv[1]):
    x @ w
    n += 1
print((time.perf_counter() - start) / n)
"""


def matmul_s(cores: Sequence[int], seconds: float) -> float:
    """Seconds per matmul on ``cores[0]`` while the same runs on every other of ``cores``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(  # one thread here: preexec_fn is safe
            [sys.executable, "-c", PROBE, str(seconds)], stdout=subprocess.PIPE, text=True,
            env=env, preexec_fn=pinned_to(core),
        )
        for core in cores
    ]  # fmt: skip
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("the matmul probe failed")
    return float(outs[0].strip())


def contention(cores: tuple[int, int]) -> float:
    """How much slower a matmul on the trainer's core runs while the follower's core runs one
    too (1.0: independent cores; ~1.5-2: two hyperthreads of one physical core, which a
    virtual machine's topology may not show)."""
    return matmul_s(cores, 3.0) / matmul_s(cores[:1], 3.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120, help="each run's train.max_steps")
    parser.add_argument(
        "--interval", type=int, default=20, help="eval.interval = checkpoint.interval"
    )
    parser.add_argument("--eval-steps", type=int, default=20, help="eval.steps (batches)")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs, ABBA order")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of timing")
    parser.add_argument("--poll-s", type=float, default=1.0, help="the follower's --poll-s")
    parser.add_argument(
        "--data", type=pathlib.Path, default=REPO / "data" / "stdlib", help="prepared data"
    )
    parser.add_argument(
        "--work", type=pathlib.Path, help="keep the runs here (else a temporary folder)"
    )
    parser.add_argument("--out", type=pathlib.Path, help="also write the report as JSON")
    args = parser.parse_args(argv)
    problems = option_problems(args)
    cores, note = cores_of()
    if cores is None:
        problems.append(f"this benchmark pins two processes: {note}")
    if problems:
        print_errors(problems)
        return 2
    assert cores is not None
    print(machine_line(cores))
    shared = contention(cores)
    print(
        f"contention: a matmul on core {cores[0]} takes {shared:.2f}x as long while core "
        f"{cores[1]} runs one too (1.00: cores of their own)"
    )
    if note is None and shared > CONTENTION_LIMIT:
        note = (
            f"cores {cores} share their vector units ({shared:.2f}x, over "
            f"{CONTENTION_LIMIT}): likely hyperthreads of one physical core"
        )
    print(
        f"debug model (dim 256, 4 layers, seq 256), {args.steps} steps, a checkpoint and an "
        f"evaluation ({args.eval_steps} batches) every {args.interval} steps; target: step time"
        f" follower beside / in-loop <= {STEP_TIME_TARGET}"
        + (f" (skipped: {note})" if note else "")
        + ", eval/loss bit-identical"
    )
    runs: list[Measured] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or pathlib.Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                runs.append(run_once(work, mode, args, cores))
                print(f"round {r + 1}: {mode} done ({runs[-1].wall_s:.1f} s)", flush=True)
    report = report_of(runs, args) | {"matmul_contention": round(shared, 3)}
    print()
    print_report(report, runs, note)
    if args.out is not None:
        replace_file(args.out, json.dumps(report, indent=2) + "\n")
    identical = report["eval_loss_max_abs_diff"] == 0.0
    return 0 if identical and not any(report["eval_loss_steps_unmatched"]) else 1


if __name__ == "__main__":
    sys.exit(main())
