"""TensorBoard, Weights & Biases (offline) and the plot script, read back from what they wrote."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_script import TRAIN, load_script, nothing_written, run_dir

LONGER = ("--checkpoint.schedule_from=config",)  # a longer cosine decays over more steps


def step_records(config) -> list[dict]:
    lines = (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_tensorboard_events_equal_the_jsonl_and_a_resume_continues_them(tiny_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = [str(tiny_config), "--metrics.tensorboard=true", "--metrics.log_interval=2"]
    assert TRAIN.main([*args, "--train.max_steps=4"]) == 0
    assert TRAIN.main([*args, "--train.max_steps=8", *LONGER]) == 0  # resumes at step 4
    events = EventAccumulator(str(run_dir(tiny_config) / "tensorboard"))
    events.Reload()
    loss = events.Scalars("loss")
    records = step_records(tiny_config)
    assert [e.step for e in loss] == [r["step"] for r in records] == [1, 2, 4, 6, 8]
    for event, record in zip(loss, records, strict=True):
        assert event.value == pytest.approx(record["loss"], rel=1e-6)
    assert {"grad_norm", "lr", "tokens_per_sec", "mfu", "memory/rss_gb"} <= set(
        events.Tags()["scalars"]
    )


def test_wandb_offline_writes_its_run_and_a_resume_reuses_the_id(tiny_config, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = [str(tiny_config), "--metrics.wandb=true", '--metrics.wandb_tags=["ci"]']
    assert TRAIN.main([*args, "--train.max_steps=3"]) == 0
    run_id = (run_dir(tiny_config) / "wandb_run_id").read_text().strip()
    assert TRAIN.main([*args, "--train.max_steps=6", *LONGER]) == 0
    folders = sorted((run_dir(tiny_config) / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, and "-1" after it when both runs started within one second
    same_id = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(folders) == 2 and all(same_id.fullmatch(f.name) for f in folders)
    assert all(any(f.glob("*.wandb")) for f in folders)  # the run's records


def test_a_sink_without_its_package_is_one_line_exit_2(tiny_config, capsys, monkeypatch):
    import forge.metrics.backends as backends

    missing = (("metrics.tensorboard", "no_such_tensorboard_pkg", "tensorboard"),)
    monkeypatch.setattr(backends, "OPTIONAL_SINKS", missing + backends.OPTIONAL_SINKS[1:])
    assert TRAIN.main([str(tiny_config), "--metrics.tensorboard=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: metrics.tensorboard: needs the 'no_such_tensorboard_pkg' package; install it "
        "with pip install 'forge[tensorboard]' (or set the key to false)"
    ]
    assert nothing_written(tiny_config)


PLOT = [sys.executable, str(REPO / "scripts" / "plot_metrics.py")]


def write_metrics(folder, scale: float) -> None:
    folder.mkdir()
    lines = [
        {"step": s, "loss": scale * 4 / s, "grad_norm": 1 / s, "lr": 1e-3, "tokens_per_sec": 5e3}
        for s in range(1, 21)
    ]
    lines.append({"step": 20, "eval/loss": scale * 0.3, "eval/perplexity": 1.35})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "{torn")


def test_plot_metrics_overlays_runs_into_a_png(tmp_path):
    write_metrics(tmp_path / "a", 1.0)
    write_metrics(tmp_path / "b", 0.8)
    out = tmp_path / "plots" / "curves.png"
    done = subprocess.run(
        [*PLOT, str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl"), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    again = subprocess.run([*PLOT, str(tmp_path / "a"), "--out", str(out)], capture_output=True,
                           text=True, check=False)  # fmt: skip
    assert again.returncode == 0, again.stderr  # its own image, marked: written over
    assert out.read_bytes() != data


def test_plot_metrics_of_a_missing_run_is_one_line_exit_2(tmp_path):
    done = subprocess.run(
        [*PLOT, str(tmp_path / "nope"), "--out", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope'}: no metrics.jsonl here; pass a run directory or its file"
    ]
    assert not (tmp_path / "c.png").exists()


PLOT_SCRIPT = load_script("plot_metrics")


def loss_at(step: int, loss: float) -> dict:
    """The follower's held-out loss line (scripts/eval_follow.py)."""
    return {"step": step, "what": "loss", "eval/loss": loss, "eval/perplexity": 2.0 * loss,
            "eval/tokens": 640, "checkpoint": f"runs/a/checkpoints/step_{step}"}  # fmt: skip


def task_at(step: int, acc: float) -> dict:
    """The follower's line of an lm-eval task's scores."""
    return {"step": step, "what": "lines", "eval/lines/acc": acc, "eval/lines/acc_norm": acc / 2,
            "checkpoint": f"runs/a/checkpoints/step_{step}"}  # fmt: skip


def skipped_at(step: int, what: str = "loss") -> dict:
    return {"step": step, "what": what, "skipped": "removed by retention before the follower"}


def follower(*records: dict, tail: bytes = b"") -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail


TORN = b'{"step": 15, "what": "loss", "eval/lo'  # a follower killed mid-write

# (case, eval_follow.jsonl (None: none), the eval series expected {key: (steps, values)}, the
# downstream panel's keys); write_metrics' run logged eval/loss 0.3 at step 20 itself
FOLLOWED = [
    ("no follower file", None, {"eval/loss": ([20], [0.3]), "eval/perplexity": ([20], [1.35])}, []),
    ("an empty follower file", b"", {"eval/loss": ([20], [0.3])}, []),
    ("losses merged by step", follower(loss_at(5, 1.5), loss_at(10, 0.9)), {"eval/loss": ([5, 10, 20], [1.5, 0.9, 0.3]), "eval/perplexity": ([5, 10, 20], [3.0, 1.8, 1.35])}, []),
    ("a step both scored: the run's own value, once", follower(loss_at(10, 0.9), loss_at(20, 0.31)), {"eval/loss": ([10, 20], [0.9, 0.3]), "eval/perplexity": ([10, 20], [1.8, 1.35])}, []),
    ("skipped steps add nothing", follower(loss_at(5, 1.5), skipped_at(10), skipped_at(10, "lines")), {"eval/loss": ([5, 20], [1.5, 0.3])}, []),
    ("tasks reach the downstream panel", follower(loss_at(10, 0.9), task_at(10, 0.25), task_at(15, 0.5)), {"eval/loss": ([10, 20], [0.9, 0.3]), "eval/lines/acc": ([10, 15], [0.25, 0.5]), "eval/lines/acc_norm": ([10, 15], [0.125, 0.25])}, ["eval/lines/acc", "eval/lines/acc_norm"]),
    ("a torn last line is passed over", follower(loss_at(5, 1.5), tail=TORN), {"eval/loss": ([5, 20], [1.5, 0.3])}, []),
    ("only a skipped step, torn after it", follower(skipped_at(5), tail=TORN), {"eval/loss": ([20], [0.3])}, []),
]  # fmt: skip


@pytest.mark.parametrize(
    "lines,expected,downstream", [c[1:] for c in FOLLOWED], ids=[c[0] for c in FOLLOWED]
)
def test_plot_metrics_merges_the_followers_scores_by_step(tmp_path, lines, expected, downstream):
    write_metrics(tmp_path / "a", 1.0)
    if lines is not None:
        (tmp_path / "a" / "eval_follow.jsonl").write_bytes(lines)
    runs = PLOT_SCRIPT.load_runs([tmp_path / "a"]).runs
    records = runs[tmp_path / "a"]
    for key, (steps, values) in expected.items():
        got = PLOT_SCRIPT.series(records, key)
        assert got[0] == steps, key
        assert got[1] == pytest.approx(values), key
    assert PLOT_SCRIPT.series(records, "loss")[0] == list(range(1, 21))  # the run's own, as is
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    assert all("skipped" not in r and "what" not in r for r in records)
    panels = PLOT_SCRIPT.panels_of(runs)
    assert [k for _, keys, _ in panels[4:] for k, _ in keys] == downstream
    # the metrics file named itself: the run's records only, no follower read
    alone = PLOT_SCRIPT.load_runs([tmp_path / "a" / "metrics.jsonl"]).runs
    assert PLOT_SCRIPT.series(next(iter(alone.values())), "eval/loss")[0] == [20]


def test_plot_metrics_draws_a_followed_run(tmp_path):
    write_metrics(tmp_path / "a", 1.0)
    (tmp_path / "a" / "eval_follow.jsonl").write_bytes(
        follower(loss_at(5, 1.5), skipped_at(10), task_at(15, 0.5), tail=TORN)
    )
    out = tmp_path / "curves.png"
    done = subprocess.run(
        [*PLOT, str(tmp_path / "a"), "--out", str(out)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def metrics_with(line: int, bad: bytes):
    """A run folder setup: ``write_metrics``'s file with its line ``line`` replaced by ``bad``
    (a line in the middle: the last line stays intact)."""

    def setup(root):
        write_metrics(root / "a", 1.0)
        lines = (root / "a" / "metrics.jsonl").read_bytes().split(b"\n")
        lines[line - 1] = bad
        (root / "a" / "metrics.jsonl").write_bytes(b"\n".join(lines))
        return []

    return setup


def out_at(name: str, make=lambda path: None):
    """A run folder setup: a sound run, ``--out`` at ``name`` (``make`` prepares that path)."""

    def setup(root):
        write_metrics(root / "a", 1.0)
        make(root / name)
        return ["--out", str(root / name)]

    return setup


def follower_with(data: bytes | None):
    """A run folder setup: a sound run whose ``eval_follow.jsonl`` is ``data`` (None: a folder)."""

    def setup(root):
        write_metrics(root / "a", 1.0)
        path = root / "a" / "eval_follow.jsonl"
        path.mkdir() if data is None else path.write_bytes(data)
        return []

    return setup


FILE = "a/metrics.jsonl"
FOLLOW = "a/eval_follow.jsonl"
FIX = "fix or delete that line (a run writes one JSON object per line)"
FORMATS = ".avif, .eps, .gif, .jpeg, .jpg, .pdf, .pgf, .png, .ps, .raw, .rgba, .svg, .svgz, .tif, .tiff, .webp"

# (case, setup of the run folder under tmp_path returning extra arguments, the one error line;
# {root} is tmp_path)
BAD_PLOTS = [
    ("an invalid byte", metrics_with(4, b'{"step": 4, "loss": 1.0\xff}'), f"{{root}}/{FILE}:4: not UTF-8 (byte 23 of the line); {FIX}"),
    ("a malformed line", metrics_with(7, b"garbage"), f"{{root}}/{FILE}:7: not a JSON line (Expecting value); {FIX}"),
    ("a line torn mid-file", metrics_with(2, b'{"step": 2, "lo'), f"{{root}}/{FILE}:2: not a JSON line (Unterminated string starting at); {FIX}"),
    ("a damaged follower line", follower_with(follower(loss_at(5, 1.5)) + b"garbage\n" + follower(loss_at(10, 0.9))), f"{{root}}/{FOLLOW}:2: not a JSON line (Expecting value); {FIX}"),
    ("a follower file that is a folder", follower_with(None), f"{{root}}/{FOLLOW}: cannot be read (Is a directory)"),
    ("--out of no image format", out_at("curves.txt"), f"--out {{root}}/curves.txt: name the image format by its suffix, one of {FORMATS}"),
    ("--out without a suffix", out_at("curves"), f"--out {{root}}/curves: name the image format by its suffix, one of {FORMATS}"),
    ("--out a folder", out_at("c.png", lambda p: p.mkdir()), "--out {root}/c.png: is a folder; name the image file to write"),
    ("--out below a file", out_at("f/c.png", lambda p: p.parent.write_text("x")), "--out {root}/f/c.png: lies below the file {root}/f; choose another --out"),
    ("--out a file of the user's", out_at("mine.png", lambda p: p.write_text("my precious")), "--out {root}/mine.png: holds a file forge did not write there; choose a new file name"),
]  # fmt: skip


@pytest.mark.parametrize("setup,error", [c[1:] for c in BAD_PLOTS], ids=[c[0] for c in BAD_PLOTS])
def test_plot_metrics_of_a_damaged_file_or_a_bad_out_is_one_line_exit_2_and_no_image(
    tmp_path, setup, error
):
    extra = setup(tmp_path) or ["--out", str(tmp_path / "c.png")]
    before = sorted(tmp_path.rglob("*"))
    done = subprocess.run(
        [*PLOT, str(tmp_path / "a"), *extra], capture_output=True, text=True, check=False
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: {error.format(root=tmp_path)}"]
    assert sorted(tmp_path.rglob("*")) == before  # no image, no temporary file


def test_tensorboard_drops_what_a_crashed_run_logged_past_its_checkpoint(sandbox):
    """Killed at step 7 with the last checkpoint at 4: steps 6 (logged, then lost) and the
    resumed run's 6 appear once, with the resumed run's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.e2e.sandbox import train

    args = ["--metrics.tensorboard=true", "--metrics.log_interval=2", "--train.max_steps=8"]
    args.append("--checkpoint.interval=4")
    crashed = train(sandbox, *args, env={"FORGE_FAULTS": "signal:step=7:sig=KILL"})
    assert crashed.code == -9
    assert train(sandbox, *args).code == 0
    events = EventAccumulator(str(sandbox.dir / "tensorboard"))
    events.Reload()
    loss = events.Scalars("loss")
    lines = (sandbox.dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    assert [e.step for e in loss] == [r["step"] for r in records] == [1, 2, 4, 6, 8]
    for event, record in zip(loss, records, strict=True):
        assert event.value == pytest.approx(record["loss"], rel=1e-6)


def lines_of(*values: object, tail: bytes = b"") -> bytes:
    return b"".join(json.dumps(v).encode() + b"\n" for v in values) + tail


# (case, metrics.jsonl, the loss series plotted (steps, values), lines passed over, records
# holding a plotted key not plotted)
ODD_RECORDS = [
    ("sound records", lines_of({"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}), ([1, 2], [2.0, 1.0]), 0, 0),
    ("a torn last line", lines_of({"step": 1, "loss": 2.0}, tail=b'{"step": 2, "lo'), ([1], [2.0]), 1, 0),
    ("JSON of another shape", lines_of([1, 2], {"loss": 3.0}, 7, {"step": 1, "loss": 2.0}), ([1], [2.0]), 3, 0),
    ("a step that is no number", lines_of({"step": "x", "loss": 1.5}, {"step": 2, "loss": 1.0}), ([2], [1.0]), 0, 1),
    ("a bool, a string, a null", lines_of({"step": 1, "loss": True}, {"step": 2, "loss": "1"}, {"step": 3, "grad_norm": None}, {"step": 4, "loss": 1.0}), ([4], [1.0]), 0, 3),
    ("NaN and inf are numbers (gaps)", b'{"step": 1, "loss": NaN}\n{"step": 2, "loss": Infinity}\n', ([1, 2], [math.nan, math.inf]), 0, 0),
    ("a record of other keys only", lines_of({"step": 1, "loss": 2.0}, {"step": 1, "checkpoint/bytes": "x"}), ([1], [2.0]), 0, 0),
]  # fmt: skip


@pytest.mark.parametrize(
    "data,loss,passed_over,unplotted", [c[1:] for c in ODD_RECORDS], ids=[c[0] for c in ODD_RECORDS]
)
def test_plot_metrics_counts_what_it_does_not_plot(tmp_path, data, loss, passed_over, unplotted):
    (tmp_path / "metrics.jsonl").write_bytes(data)
    read = PLOT_SCRIPT.read_records(tmp_path / "metrics.jsonl")
    assert read.passed_over == passed_over
    steps, values = PLOT_SCRIPT.series(read.records, "loss")
    assert steps == loss[0]
    assert values == pytest.approx(loss[1], nan_ok=True)
    runs = {tmp_path: read.records}
    notes = PLOT_SCRIPT.unplotted_notes(runs, PLOT_SCRIPT.panels_of(runs))
    assert notes == ([f"({unplotted} record{'s' if unplotted > 1 else ''} of {tmp_path} not plotted: a step or a value there is no number)"] if unplotted else [])  # fmt: skip


def test_plot_metrics_says_what_it_passed_over(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_bytes(
        lines_of(
            {"step": 1, "loss": 2.0}, [1], {"step": "x", "loss": 1.0}, {"step": 3, "loss": 1.0}
        )
        + b'{"step": 4'
    )
    out = tmp_path / "c.png"
    done = subprocess.run(
        [*PLOT, str(tmp_path / "a"), "--out", str(out)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"wrote {out}",
        f"(2 lines of {tmp_path}/a/metrics.jsonl passed over: cut short by a crash, or not a "
        "metric record, a JSON object with a step)",
        f"(1 record of {tmp_path}/a not plotted: a step or a value there is no number)",
    ]
