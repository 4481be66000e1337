"""Plot training curves of one or more runs: ``python scripts/plot_metrics.py runs/a runs/b``.

Reads each run's ``metrics.jsonl`` (a run directory or the file itself) and draws, against the
step, the train and eval loss, the learning rate, the gradient norm and tokens per second, the
runs overlaid with a legend. Needs matplotlib: ``pip install 'forge[plot]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from forge.errors import print_errors
from forge.types import ExitCode

PANELS = (  # (title, [(metric key, line style label)], log scale)
    ("loss", [("loss", "train"), ("eval/loss", "eval")], False),
    ("learning rate", [("lr", "")], False),
    ("gradient norm", [("grad_norm", "")], True),
    ("tokens / s", [("tokens_per_sec", "")], False),
)


def metrics_file(path: pathlib.Path) -> pathlib.Path:
    """The JSONL of a run: ``path`` itself, or ``path/metrics.jsonl``."""
    return path / "metrics.jsonl" if path.is_dir() else path


def read_records(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every JSON object of a metrics file (a line torn by a crash is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The steps and values of ``key`` (records without it are skipped)."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def input_problems(runs: Sequence[pathlib.Path]) -> list[str]:
    """A line for each run whose metrics file is missing or holds no records."""
    problems = []
    for run in runs:
        path = metrics_file(run)
        if not path.is_file():
            problems.append(f"{run}: no metrics.jsonl here; pass a run directory or its file")
        elif not read_records(path):
            problems.append(f"{path}: holds no metric records")
    return problems


def plot(runs: Sequence[pathlib.Path], out: pathlib.Path) -> None:
    """Draw the four panels for every run into ``out`` (PNG, PDF or SVG by its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (title, keys, log) in zip(axes.flat, PANELS, strict=True):
        for run in runs:
            records = read_records(metrics_file(run))
            name = run.name if run.is_dir() else run.parent.name
            for key, label in keys:
                steps, values = series(records, key)
                if steps:
                    style = "o--" if key.startswith("eval/") else "-"
                    ax.plot(steps, values, style, label=f"{name} {label}".strip(), markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="run directories or files")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("curves.png"))
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print_errors(
            ["plot_metrics.py needs matplotlib; install it with pip install 'forge[plot]'"]
        )
        return ExitCode.CONFIG_ERROR
    problems = input_problems(args.runs)
    if problems:
        print_errors(problems)
        return ExitCode.CONFIG_ERROR
    plot(args.runs, args.out)
    print(f"wrote {args.out}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
