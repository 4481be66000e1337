"""Where a run's wall time went: ``python scripts/goodput.py runs/debug``.

Reads the run's goodput ledger (``<run.dir>/goodput.jsonl``, written by every launch) and
prints one row per launch (when it started, its steps, its wall time and its largest buckets,
whether it ended or was killed) and the run's totals: each bucket's seconds and share of the
wall time, and goodput, the productive share (docs/observability.md#the-goodput-ledger).
"""

from __future__ import annotations

import argparse

from forge.cli import help_first, run_path, summary


def parser() -> argparse.ArgumentParser:
    """The options ``main`` reads, built before torch is imported (``help_first``)."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("run", type=run_path, help="a run directory")
    return parser


help_first(__name__, lambda args: parser().parse_args(args))

import pathlib
import sys
import time
from collections.abc import Sequence

from forge.console import console_may_close
from forge.errors import print_errors
from forge.interrupts import exits_on_interrupt
from forge.metrics.goodput import (
    LEDGER_FILE,
    Bucket,
    LaunchRecord,
    launched_by,
    ledger_lines,
    run_totals,
    summary_line,
)
from forge.training.records.run_dir import holder_pid, trainer_running
from forge.types import ExitCode


def launch_rows(run_dir: pathlib.Path, launches: list[LaunchRecord]) -> list[str]:
    """One line per launch, then the run's buckets, then its summary line. While a trainer
    holds the run, its launch (the last line, when its own) is running: its steps past its
    last save are not lost yet."""
    running = None
    if launches and not launches[-1].ended and trainer_running(run_dir):
        # the last line is the running launch's only once it wrote one: its id ends with
        # rank 0's pid, which the lock names (before, it loads: the last line is a dead one's)
        running = launches[-1] if launched_by(launches[-1], holder_pid(run_dir)) else None
    lines = []
    for i, r in enumerate(launches, 1):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started))
        if r is running:
            how = "running"
        elif r.ended:
            how = "ended"
        else:
            how = f"killed ({r.uncommitted:.1f} s past its last save lost)"
        top = sorted(r.seconds.items(), key=lambda kv: -kv[1])[:3]
        spent = ", ".join(f"{name} {s:.1f} s" for name, s in top)
        lines.append(f"launch {i}  {when}  to step {r.step:<6} {r.wall:8.1f} s  {how}: {spent}")
    totals = run_totals(launches[:-1], running) if running else run_totals(launches)
    wall = sum(totals.values())
    lines.append("")
    for bucket in Bucket:
        share = totals[bucket] / wall if wall > 0 else 0.0
        lines.append(f"{bucket.value:<12} {totals[bucket]:10.1f} s  {share:6.1%}")
    lines.append("")
    lines.append(summary_line(totals, len(launches)))
    return lines


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    ledger = args.run / LEDGER_FILE
    if ledger.exists() and not ledger.is_file():
        print_errors([f"{ledger}: not a regular file (a folder, a FIFO or a device); no ledger"])
        return ExitCode.CONFIG_ERROR
    if not ledger.is_file():
        print_errors(
            [
                f"{args.run}: no {LEDGER_FILE} (a run directory trained by this forge keeps "
                "one); pass the run.dir of a training run"
            ]
        )
        return ExitCode.CONFIG_ERROR
    launches, passed_over = ledger_lines(ledger)
    if not launches:
        print_errors(
            [
                f"{ledger}: no line of it is a launch's record (every launch that trains writes "
                "one; this file is empty or damaged), so it tells nothing of the run"
            ]
        )
        return ExitCode.CONFIG_ERROR
    print("\n".join(launch_rows(args.run, launches)))
    if passed_over:
        print(
            f"({passed_over} line{'s' if passed_over > 1 else ''} of {ledger} passed over: cut "
            "short by a crash, or damaged; the launches above are read from the others)"
        )
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
