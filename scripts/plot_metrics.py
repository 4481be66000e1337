"""Plot training curves of one or more runs: ``python scripts/plot_metrics.py runs/a runs/b``.

Reads each run's ``metrics.jsonl`` (a run directory or the file itself) and draws, against the
step, the train and eval loss, the learning rate, the gradient norm and tokens per second (and
the downstream scores ``eval/<task>/<metric>`` of ``[[eval.tasks]]`` where a run has them), the
runs overlaid with a legend. Needs matplotlib: ``pip install 'forge[plot]'``.

A run directory's ``eval_follow.jsonl`` (``scripts/eval_follow.py``'s results, when the run was
evaluated beside its training) is read too and merged by step: its ``eval/...`` scores appear
in the same panels as in-loop evaluation's; a step the follower skipped adds nothing.

A run (and its follower) writes one JSON object per line. A last line without its newline is
what a crash mid-write leaves: it is skipped. Any other line that is not UTF-8 JSON is damage,
not a torn write: the script refuses it in one line naming the file and the line number, and
plots nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from forge.cli import summary
from forge.console import console_may_close
from forge.errors import UserInputError, print_errors
from forge.interrupts import exits_on_interrupt
from forge.outputs import file_output_problem
from forge.types import ExitCode

Records = list[dict[str, Any]]
Panel = tuple[str, list[tuple[str, str]], bool]  # (title, [(metric key, label)], log scale)

PANELS: tuple[Panel, ...] = (
    ("loss", [("loss", "train"), ("eval/loss", "eval")], False),
    ("learning rate", [("lr", "")], False),
    ("gradient norm", [("grad_norm", "")], True),
    ("tokens / s", [("tokens_per_sec", "")], False),
)
FOLLOW_FILE = "eval_follow.jsonl"  # scripts/eval_follow.py's results in a run directory


def metrics_file(path: pathlib.Path) -> pathlib.Path:
    """The JSONL of a run: ``path`` itself, or ``path/metrics.jsonl``."""
    return path / "metrics.jsonl" if path.is_dir() else path


class MetricsFile(NamedTuple):
    """A metrics file's records (JSON objects with a ``step``), and how many of its lines
    are none: the last line cut short by a crash, or a JSON value of another shape."""

    records: Records
    passed_over: int


def read_records(path: pathlib.Path) -> MetricsFile:
    """Every metric record (a JSON object with a ``step``) of a metrics file; a line that is
    not UTF-8 JSON is a ``UserInputError`` naming the file and line, unless it is the last
    line torn by a crash (no newline after it), which is passed over and counted."""
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as exc:
        raise UserInputError(f"{path}: cannot be read ({exc.strerror})") from None
    records, passed_over = [], 0
    for number, line in enumerate(lines, 1):
        torn = number == len(lines)  # after the last newline: a crash's partial write
        record = parse_line(path, number, line, torn)
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        elif line.strip():
            passed_over += 1
    return MetricsFile(records, passed_over)


def parse_line(path: pathlib.Path, number: int, line: bytes, torn: bool) -> Any:
    """The JSON value of line ``number`` (None: blank, or ``torn`` and unreadable)."""
    fix = "fix or delete that line (a run writes one JSON object per line)"
    if not line.strip():
        return None
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        if torn:
            return None
        raise UserInputError(
            f"{path}:{number}: not UTF-8 (byte {exc.start} of the line); {fix}"
        ) from None
    except json.JSONDecodeError as exc:
        if torn:
            return None
        raise UserInputError(f"{path}:{number}: not a JSON line ({exc.msg}); {fix}") from None


def merge_follow(records: Records, follow: Records) -> Records:
    """``records`` (a run's ``metrics.jsonl``) with the follower's scores merged in by step:
    one record per step the follower scored, holding its ``eval/...`` values that the run did
    not log itself at that step (in-loop evaluation's value stands; the follower computes the
    same), placed by step among the run's records. A skipped step (``skipped``, no scores)
    and a record without an integer step add nothing."""
    logged = {(r["step"], k) for r in records if type(r["step"]) is int for k in r}
    scores: dict[int, dict[str, Any]] = {}
    for r in follow:
        step = r["step"]
        if type(step) is not int or "skipped" in r:
            continue
        for key, value in r.items():
            if key.startswith("eval/") and (step, key) not in logged:
                scores.setdefault(step, {"step": step})[key] = value
    if not scores:
        return records

    def order(r: dict[str, Any]) -> float:  # a step that is no number: last, as before
        step = r["step"]
        return step if isinstance(step, int | float) and not isinstance(step, bool) else math.inf

    return sorted(records + list(scores.values()), key=order)  # stable: the run's order kept


def plottable(value: Any) -> bool:
    """Whether a record's step or value is a number to plot (a bool is none; NaN and inf
    are, drawn as the gaps they are)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The steps and values of ``key`` (records without it, or whose step or value is no
    number, are skipped: ``unplotted`` counts the latter)."""
    pairs = [(r["step"], r[key]) for r in records if plottable(r.get(key)) and plottable(r["step"])]
    return [s for s, _ in pairs], [v for _, v in pairs]


def unplotted(records: Records, keys: Sequence[str]) -> int:
    """Records that hold one of ``keys`` but that ``series`` skips: a step or a value
    that is no number."""
    return sum(
        1
        for r in records
        if any(k in r for k in keys)
        and not all(plottable(r[k]) and plottable(r["step"]) for k in keys if k in r)
    )


class Loaded(NamedTuple):
    """Each run's records, and a line for each file with lines that are no metric record."""

    runs: dict[pathlib.Path, Records]
    notes: list[str]


def load_runs(runs: Sequence[pathlib.Path]) -> Loaded:
    """Each run's records, a run directory's ``eval_follow.jsonl`` merged in; a
    ``UserInputError`` with a line for each run whose metrics file is missing, unreadable,
    damaged or holds no records, or whose ``eval_follow.jsonl`` is unreadable or damaged."""
    loaded, problems, notes = {}, [], []
    for run in runs:
        path = metrics_file(run)
        if not path.is_file():
            problems.append(f"{run}: no metrics.jsonl here; pass a run directory or its file")
            continue
        follow = run / FOLLOW_FILE
        try:
            files = [(path, read_records(path))]
            if run.is_dir() and follow.exists():
                files.append((follow, read_records(follow)))
        except UserInputError as exc:
            problems += exc.lines
            continue
        loaded[run] = files[0][1].records
        if len(files) > 1:
            loaded[run] = merge_follow(loaded[run], files[1][1].records)
        notes += [passed_over_note(name, file.passed_over) for name, file in files]
        if not loaded[run]:
            problems.append(f"{path}: holds no metric records")
    if problems:
        raise UserInputError(problems)
    return Loaded(loaded, [n for n in notes if n])


def passed_over_note(path: pathlib.Path, lines: int) -> str:
    """The line that says how many lines of ``path`` are no metric record ('' for none)."""
    if not lines:
        return ""
    return (
        f"({lines} line{'s' if lines > 1 else ''} of {path} passed over: cut short by a crash, "
        "or not a metric record, a JSON object with a step)"
    )


def unplotted_notes(runs: dict[pathlib.Path, Records], panels: list[Panel]) -> list[str]:
    """A line for each run with records of a plotted key whose step or value is no number."""
    keys = [key for _, lines, _ in panels for key, _ in lines]
    notes = []
    for run, records in runs.items():
        if n := unplotted(records, keys):
            notes.append(
                f"({n} record{'s' if n > 1 else ''} of {run} not plotted: a step or a value "
                "there is no number)"
            )
    return notes


# what marks an image this script wrote (the metadata key each format keeps it under): only
# such an image is written over, never a file of the user's at --out
MARK = "forge plot_metrics.py"
MARK_KEYS = {"png": "Software", "pdf": "Creator", "svg": "Creator"}


def written_here(path: pathlib.Path) -> bool:
    """Whether ``path`` is an image this script wrote (its mark is in its bytes)."""
    try:
        return MARK.encode() in path.read_bytes()
    except OSError:
        return False


def out_problems(out: pathlib.Path) -> list[str]:
    """A line when ``--out`` names no image format matplotlib writes, is a folder, lies below
    a file, or breaks the rule of every file a script writes (``file_output_problem``: never
    over a file this script did not write — only PNG, PDF and SVG carry its mark, so another
    format's file is never written over — nor into a run or a dataset but the run's
    ``plots/``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = sorted(FigureCanvasAgg.get_supported_filetypes())
    if out.suffix.lstrip(".").lower() not in formats:
        return [f"--out {out}: name the image format by its suffix, one of .{', .'.join(formats)}"]
    if out.is_dir():
        return [f"--out {out}: is a folder; name the image file to write"]
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        return [f"--out {out}: lies below the file {above}; choose another --out"]
    problem = file_output_problem(out, "--out", "plots", written_here)
    return [problem] if problem is not None else []


def downstream_keys(runs: dict[pathlib.Path, Records]) -> list[str]:
    """Every ``eval/<task>/<metric>`` key the runs logged ([[eval.tasks]]), sorted."""
    return sorted(
        {
            k
            for records in runs.values()
            for r in records
            for k in r
            if k.startswith("eval/") and k.count("/") == 2
        }
    )


def panels_of(runs: dict[pathlib.Path, Records]) -> list[Panel]:
    """The four panels, and a fifth of downstream scores when the runs have any."""
    keys = downstream_keys(runs)
    extra = [("downstream tasks", [(k, k.removeprefix("eval/")) for k in keys], False)]
    return list(PANELS) + (extra if keys else [])


def plot(runs: dict[pathlib.Path, Records], out: pathlib.Path) -> None:
    """Draw the panels for every run into ``out`` (PNG, PDF or SVG by its suffix),
    written to a temporary sibling and renamed: a failed save leaves no partial image."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    panels = panels_of(runs)
    columns = 2 if len(panels) <= 4 else 3
    fig, axes = plt.subplots(2, columns, figsize=(6 * columns, 8))
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, keys, log) in zip(axes.flat, panels, strict=False):
        for run, records in runs.items():
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
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        image = out.suffix.lstrip(".").lower()
        mark = {MARK_KEYS[image]: MARK} if image in MARK_KEYS else None
        fig.savefig(tmp, format=image, metadata=mark)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="run directories or files")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("curves.png"))
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print_errors(
            ["plot_metrics.py needs matplotlib; install it with pip install 'forge[plot]'"]
        )
        return ExitCode.CONFIG_ERROR
    try:
        runs, notes = load_runs(args.runs)
        problems = out_problems(args.out)
        if problems:
            raise UserInputError(problems)
        plot(runs, args.out)
    except UserInputError as exc:
        print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    except OSError as exc:
        print_errors([f"--out {args.out}: cannot write the plot ({exc.strerror or exc})"])
        return ExitCode.CONFIG_ERROR
    print("\n".join([f"wrote {args.out}", *notes, *unplotted_notes(runs, panels_of(runs))]))
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
