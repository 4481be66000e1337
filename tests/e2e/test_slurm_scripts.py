"""The sbatch scripts under fake srun / scontrol: syntax, signal forwarding and requeue; the
follower's job also under the stand-in srun with the real eval_follow.py."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest

from tests.conftest import REPO
from tests.launched import wait_for_line

SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"

FAKE_SRUN = """#!/bin/bash
# Records its arguments, then behaves like a training job: exit 75 on USR1/TERM, else 0.
echo "$@" > "$SHIM_DIR/srun.args"
trap 'echo USR1 > "$SHIM_DIR/srun.signal"; exit 75' USR1
trap 'echo TERM > "$SHIM_DIR/srun.signal"; exit 75' TERM
touch "$SHIM_DIR/srun.started"
for _ in $(seq 1 {ticks}); do sleep 0.1; done
exit "${FAKE_EXIT:-0}"
"""

FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$SHIM_DIR/scontrol.calls"
"""


def shims(tmp: pathlib.Path, ticks: int) -> dict[str, str]:
    for name, body in (
        ("srun", FAKE_SRUN.replace("{ticks}", str(ticks))),
        ("scontrol", FAKE_SCONTROL),
    ):
        path = tmp / name
        path.write_text(body)
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{tmp}:{os.environ['PATH']}", "SHIM_DIR": str(tmp),
            "SLURM_JOB_ID": "4242", "CONFIG": "configs/train/debug.toml"}  # fmt: skip


def start(
    tmp: pathlib.Path,
    ticks: int,
    script: pathlib.Path = SCRIPT,
    args: Sequence[str] = ("--train.max_steps=10",),
    env: dict[str, str] | None = None,
    **extra: str,
) -> subprocess.Popen:
    """``script`` started as sbatch would, with ``args``, under ``env`` (default: the shims'
    with ``ticks``) and ``extra``; returns once the fake srun has started."""
    proc = subprocess.Popen(
        ["bash", str(script), *args],
        cwd=REPO, env={**(env or shims(tmp, ticks)), **extra}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not (tmp / "srun.started").exists():
        assert time.monotonic() < deadline, "fake srun never started"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("name", ["train.sbatch", "eval_follow.sbatch"])
def test_sbatch_script_parses(name):
    script = REPO / "scripts" / "slurm" / name
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_warning_signal_is_forwarded_and_the_job_requeued(tmp_path):
    proc = start(tmp_path, ticks=100)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 75, out
    assert (tmp_path / "srun.signal").read_text().strip() == "USR1"
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "4242"]
    args = (tmp_path / "srun.args").read_text().split()
    assert args[-3:] == ["scripts/train.py", "configs/train/debug.toml", "--train.max_steps=10"]


def test_sigterm_is_forwarded_too(tmp_path):
    proc = start(tmp_path, ticks=100)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == 75
    assert (tmp_path / "srun.signal").read_text().strip() == "TERM"


def test_a_clean_finish_is_not_requeued(tmp_path):
    proc = start(tmp_path, ticks=3)
    proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert not (tmp_path / "scontrol.calls").exists()


def test_a_replay_mismatch_is_not_requeued_onto_the_same_nodes(tmp_path):
    proc = start(tmp_path, ticks=3, FAKE_EXIT="6", SLURM_JOB_NODELIST="gpu[003-004]")
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 6
    assert not (tmp_path / "scontrol.calls").exists()
    assert "not requeued onto suspect hardware" in out and "gpu[003-004]" in out
    assert "--exclude=<host>" in out


def test_the_script_creates_its_log_folder_and_uses_the_venv(tmp_path):
    proc = start(tmp_path, ticks=3)
    proc.communicate(timeout=20)
    assert (REPO / "logs").is_dir()  # --output=logs/%x-%j.out of later submissions lands
    args = (tmp_path / "srun.args").read_text().split()
    python = args[args.index("scripts/train.py") - 1]
    assert python == (".venv/bin/python" if (REPO / ".venv/bin/python").exists() else "python")


# train.sbatch's hint for a run evaluated beside it: (case, CONFIG's text (None: debug.toml),
# the job's arguments, its environment, the hint's RUN_DIR (None: no hint))
FOLLOW_HINTS = [
    ("a run that evaluates in its loop", None, [], {}, None),
    ("--eval.follow=true", None, ["--eval.follow=true"], {}, "runs/debug"),
    ("the config's [eval] follow, its run.dir", '[eval]\nfollow = true\n[run]\ndir = "/scratch/x"\n', [], {}, "/scratch/x"),
    ("the config's follow, overridden off", "[eval]\nfollow = true\n", ["--eval.follow=false"], {}, None),
    ("a requeued job: said once already", None, ["--eval.follow=true"], {"SLURM_RESTART_COUNT": "1"}, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "config,args,env,run_dir", [c[1:] for c in FOLLOW_HINTS], ids=[c[0] for c in FOLLOW_HINTS]
)
def test_train_script_says_how_to_start_the_follower(tmp_path, config, args, env, run_dir):
    path = "configs/train/debug.toml"
    if config is not None:
        path = str(tmp_path / "follow.toml")
        pathlib.Path(path).write_text(config)
    # this interpreter reads the config (a checkout without its own .venv would use `python`)
    proc = start(tmp_path, ticks=1, args=args, CONFIG=path, **{"PYTHON": sys.executable, **env})
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    hints = [line for line in out.splitlines() if "eval.follow" in line]
    if run_dir is None:
        assert hints == []
    else:
        assert hints == [
            "[forge-slurm] eval.follow = true: this job evaluates nothing itself; start the "
            f"follower beside it: RUN_DIR={run_dir} sbatch --dependency=after:4242 "
            "scripts/slurm/eval_follow.sbatch"
        ]


FOLLOW_SCRIPT = REPO / "scripts" / "slurm" / "eval_follow.sbatch"

FAKE_FOLLOWER = """#!/bin/bash
# Records its arguments, then behaves like eval_follow.py: exit 130 on TERM, else its exit code.
echo "$@" > "$SHIM_DIR/srun.args"
trap 'echo TERM > "$SHIM_DIR/srun.signal"; exit 130' TERM
touch "$SHIM_DIR/srun.started"
for _ in $(seq 1 {ticks}); do sleep 0.1; done
exit "${FAKE_EXIT:-0}"
"""


def start_follower(tmp: pathlib.Path, ticks: int, **env: str) -> subprocess.Popen:
    env = {**shims(tmp, ticks), "RUN_DIR": "runs/x", **env}
    (tmp / "srun").write_text(FAKE_FOLLOWER.replace("{ticks}", str(ticks)))
    return start(tmp, ticks, script=FOLLOW_SCRIPT, args=["--every", "5"], env=env)


# (case, the fake follower's run time in 0.1 s ticks, the signal sent to the batch shell, its
# environment, the job's exit code, the signal the follower got, whether the job is requeued)
FOLLOWER_JOBS = [
    ("the run completes: exit 0", 3, None, {}, 0, None, False),
    ("a refusal's exit code passes through", 3, None, {"FAKE_EXIT": "2"}, 2, None, False),
    ("SIGTERM is forwarded, no requeue", 100, signal.SIGTERM, {}, 130, "TERM", False),
    ("the time-limit warning: SIGTERM, requeued", 100, signal.SIGUSR1, {}, 130, "TERM", True),
]  # fmt: skip


@pytest.mark.parametrize(
    "ticks,sig,env,code,got,requeued",
    [c[1:] for c in FOLLOWER_JOBS],
    ids=[c[0] for c in FOLLOWER_JOBS],
)
def test_follower_job_runs_eval_follow_through_srun(tmp_path, ticks, sig, env, code, got, requeued):
    proc = start_follower(tmp_path, ticks, **env)
    if sig is not None:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == code, out
    args = (tmp_path / "srun.args").read_text().split()
    assert args[0] == "--kill-on-bad-exit=1"
    assert args[-4:] == ["scripts/eval_follow.py", "runs/x", "--every", "5"]
    signalled = tmp_path / "srun.signal"
    assert (signalled.read_text().strip() if signalled.exists() else None) == got
    calls = tmp_path / "scontrol.calls"
    assert (calls.read_text().split() if calls.exists() else []) == (
        ["requeue", "4242"] if requeued else []
    )


def test_follower_job_without_run_dir_is_one_line_exit_2(tmp_path):
    env = {**shims(tmp_path, 1)}
    env.pop("RUN_DIR", None)
    done = subprocess.run(
        ["bash", str(FOLLOW_SCRIPT), "--every", "5"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "[forge-slurm] error: RUN_DIR is not set; submit with RUN_DIR=<the trainer's run.dir> "
        "sbatch --dependency=after:<trainer job id> scripts/slurm/eval_follow.sbatch"
    ]
    assert not (tmp_path / "srun.args").exists()


def standin_job(tmp: pathlib.Path, run_dir: pathlib.Path) -> dict[str, str]:
    """The batch shell's environment for one node × one task, srun the stand-in."""
    shim_dir = tmp / "shims"
    shim_dir.mkdir()
    srun = shim_dir / "srun"
    srun.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/e2e/standin_srun.py" "$@"\n')
    scontrol = shim_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{shim_dir}/scontrol.calls"\n')
    for shim in (srun, scontrol):
        shim.chmod(0o755)
    return {**os.environ, "PATH": f"{shim_dir}:{os.environ['PATH']}", "PYTHON": sys.executable,
            "RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4243",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NTASKS": "1",
            "SLURM_JOB_NODELIST": "127.0.0.1"}  # fmt: skip


def test_follower_job_evaluates_a_run_and_ends_with_it(trained, tmp_path):
    """The trained run (steps 5 and 10 committed, max_steps 10): the follower job evaluates
    both through the stand-in srun and exits 0 on its own; plot_metrics reads the scores."""
    run = tmp_path / "run"
    shutil.copytree(trained.dir, run, symlinks=True)
    done = subprocess.run(
        ["bash", str(FOLLOW_SCRIPT), "--every", "5", "--poll-s", "0.2"],
        cwd=REPO, env=standin_job(tmp_path, run), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(x) for x in (run / "eval_follow.jsonl").read_text().splitlines()]
    assert [(r["step"], r["what"]) for r in records] == [(5, "loss"), (10, "loss")]
    assert all(r["eval/loss"] > 0 for r in records)
    assert "[eval_follow] done: the run completed" in done.stderr
    from tests.e2e.test_train_script import load_script

    plot = load_script("plot_metrics")
    steps, values = plot.series(plot.load_runs([run]).runs[run], "eval/loss")
    assert (steps, values) == ([5, 10], [r["eval/loss"] for r in records])


def test_follower_job_forwards_sigterm_to_a_waiting_follower(tmp_path):
    """A follower started before its trainer wrote the run's config.toml waits for it; the
    job's SIGTERM reaches it through the stand-in srun: exit 130, one line, nothing written."""
    run = tmp_path / "run"
    job = subprocess.Popen(
        ["bash", str(FOLLOW_SCRIPT), "--poll-s", "0.2"],
        cwd=REPO, env=standin_job(tmp_path, run), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    wait_for_line(job, "[eval_follow] waiting for", timeout_s=60)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=30)
    assert job.returncode == 130, out
    assert "interrupted (SIGTERM): stopped; nothing it was writing is left behind" in out
    assert not (tmp_path / "shims" / "scontrol.calls").exists()  # cancelled: not requeued
    assert not run.exists()


GROUP_SCRIPT = REPO / "scripts" / "slurm" / "replica_group.sbatch"
GROUP_ENV = {"LIGHTHOUSE": "http://node7:29510", "REPLICA_GROUP": "1", "REPLICA_GROUPS": "2"}


@pytest.mark.parametrize("name", ["replica_group.sbatch", "lighthouse.sbatch"])
def test_replica_group_scripts_parse(name):
    script = REPO / "scripts" / "slurm" / name
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_a_replica_group_job_passes_its_keys_to_every_task(tmp_path):
    proc = start(tmp_path, ticks=3, script=GROUP_SCRIPT, **GROUP_ENV)
    proc.communicate(timeout=20)
    assert proc.returncode == 0
    args = (tmp_path / "srun.args").read_text().split()
    assert args[-5:] == [
        "--train.max_steps=10",
        "--fault_tolerance.enabled=true",
        "--fault_tolerance.lighthouse=http://node7:29510",
        "--fault_tolerance.group=1",
        "--fault_tolerance.groups=2",
    ]


@pytest.mark.parametrize(
    "code,requeued",
    [
        ("4", True),  # a peer or the quorum lost
        ("137", True),  # killed by a signal
        ("0", False),
        ("1", False),  # a crash would recur
        ("2", False),  # bad input
        ("3", False),  # a NaN abort would recur
        ("5", False),  # a failed save
        ("6", False),  # suspect hardware
    ],
)
def test_a_lost_replica_group_is_requeued_to_heal_and_a_failure_that_would_recur_is_not(
    tmp_path, code, requeued
):
    proc = start(tmp_path, ticks=3, script=GROUP_SCRIPT, FAKE_EXIT=code, **GROUP_ENV)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == int(code)
    calls = tmp_path / "scontrol.calls"
    assert calls.exists() == requeued, out
    if requeued:
        assert "heals from its live peers" in out


def test_a_replica_group_job_without_its_keys_says_which(tmp_path):
    env = shims(tmp_path, 3)
    out = subprocess.run(
        ["bash", str(GROUP_SCRIPT)], cwd=REPO, env={**env, "LIGHTHOUSE": "http://x:1"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode != 0 and "set REPLICA_GROUP" in out.stderr
    assert not (tmp_path / "srun.started").exists()
