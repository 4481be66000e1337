"""Run directories: the path checks, the lock, whose records a directory holds; and the pure
rules for a failed save and for a run that is already complete."""

from __future__ import annotations

import pathlib
import socket

import pytest

from forge.config import dumps_toml, structure_config, unstructure_config
from forge.config.sections import NonFinitePolicy
from forge.training.loop.outcome import outcome_message
from forge.training.loop.plan import LoopPolicy, SaveReason, save_failure_is_fatal
from forge.training.records.run_dir import (
    LOCK_FILE,
    RunDirBusyError,
    foreign_records_problem,
    groups_switch_problem,
    lock_directories,
    path_problem,
)
from forge.types import LoopOutcome, LoopState


def make(tmp: pathlib.Path, spec: str) -> None:
    """``spec``: "file:a", "dir:a/b" or "" (nothing)."""
    kind, _, rel = spec.partition(":")
    if kind == "file":
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text("x")
    elif kind == "dir":
        (tmp / rel).mkdir(parents=True)


# (case, what exists, the path, the start of the problem or None)
PATHS = [
    ("new directory", "", "run", None),
    ("new nested directory", "", "a/b/run", None),
    ("existing directory", "dir:run", "run", None),
    ("a file", "file:run", "run", "run.dir: {tmp}/run is a file"),
    ("below a file", "file:a", "a/run", "run.dir: {tmp}/a/run lies below the file {tmp}/a"),
    ("deep below a file", "file:a", "a/b/c", "run.dir: {tmp}/a/b/c lies below the file {tmp}/a"),
]


@pytest.mark.parametrize("exists,rel,problem", [p[1:] for p in PATHS], ids=[p[0] for p in PATHS])
def test_path_problem(tmp_path, exists, rel, problem):
    make(tmp_path, exists)
    found = path_problem("run.dir", tmp_path / rel)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem.format(tmp=tmp_path))


def test_a_dangling_symlink_is_a_path_problem(tmp_path):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    found = path_problem("run.dir", tmp_path / "run")
    assert found is not None and "broken symbolic link" in found


def test_a_directory_locks_once_and_frees_on_release(tmp_path):
    first = lock_directories([("run.dir", tmp_path / "run")])
    with pytest.raises(RunDirBusyError, match=r"run.dir: .*/run is in use by pid \d+ on host"):
        lock_directories([("run.dir", tmp_path / "run")])
    first.release()
    lock_directories([("run.dir", tmp_path / "run")]).release()


def test_a_refused_lock_holds_nothing_and_creates_nothing(tmp_path):
    held = lock_directories([("checkpoint.dir", tmp_path / "ckpt")])
    with pytest.raises(RunDirBusyError, match=r"checkpoint\.dir"):
        lock_directories([("run.dir", tmp_path / "new"), ("checkpoint.dir", tmp_path / "ckpt")])
    assert not (tmp_path / "new").exists()  # created for the attempt, removed again
    lock_directories([("run.dir", tmp_path / "new")]).release()  # and not left locked
    held.release()


def test_release_with_discard_removes_only_what_the_lock_created(tmp_path):
    (tmp_path / "existing").mkdir()
    lock = lock_directories(
        [("run.dir", tmp_path / "existing"), ("checkpoint.dir", tmp_path / "a/b")]
    )
    lock.release(discard=True)
    assert (tmp_path / "existing").is_dir() and not (tmp_path / "a").exists()
    assert (tmp_path / "existing" / LOCK_FILE).exists() is False


def test_a_checkpoint_directory_is_its_run_directorys_alone(tmp_path):
    """Another run directory pointed at a run's checkpoint directory, later (no lock held), is
    refused naming the owner; the owner takes it again; a claim discarded by a run that never
    started leaves the directory to whoever comes next."""
    ckpt = tmp_path / "a" / "checkpoints"
    lock_directories([("run.dir", tmp_path / "a"), ("checkpoint.dir", ckpt)]).release()
    with pytest.raises(RunDirBusyError) as refused:
        lock_directories([("run.dir", tmp_path / "b"), ("checkpoint.dir", ckpt)])
    assert refused.value.lines == [
        f"checkpoint.dir: {ckpt} holds the checkpoints of another run (run.dir {tmp_path / 'a'} "
        f"on {socket.gethostname()}); choose another checkpoint.dir (checkpoint.load_path starts "
        f"a run from another's checkpoint), or delete {ckpt / 'owner.json'} if that run is gone "
        "for good"
    ]
    assert not (tmp_path / "b").exists()  # nothing written for the refused run
    lock_directories([("run.dir", tmp_path / "a"), ("checkpoint.dir", ckpt)]).release()
    fresh = tmp_path / "fresh"
    lock_directories([("run.dir", tmp_path / "c"), ("checkpoint.dir", fresh)]).release(discard=True)
    lock_directories([("run.dir", tmp_path / "d"), ("checkpoint.dir", fresh)]).release()


def write_run(run_dir: pathlib.Path, raw: dict, metrics: bool = True) -> None:
    run_dir.mkdir(parents=True)
    config = structure_config({**raw, "run": {"dir": str(run_dir)}})
    (run_dir / "config.toml").write_text(dumps_toml(unstructure_config(config)))
    if metrics:
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')


# (case, the previous run's config, its checkpoint dir, now: config, checkpoint dir, refused?)
RECORDS = [
    ("no records", None, None, {}, None, False),
    ("the same run restarting before its first checkpoint", {}, None, {}, None, False),
    ("the same run with another lr", {}, None, {"optimizer": {"lr": 1e-3}}, None, False),
    ("another checkpoint dir", {}, None, {}, "elsewhere", True),
    ("another model", {}, None, {"model": {"dim": 128}}, None, True),
    ("another data order", {}, None, {"train": {"seq_len": 128}}, None, True),
    ("the previous run's own checkpoint dir, named", {"checkpoint": {"dir": "CK"}}, "CK", {"checkpoint": {"dir": "CK"}}, "CK", False),
]  # fmt: skip


@pytest.mark.parametrize(
    "previous,previous_ckpt,now,now_ckpt,refused",
    [r[1:] for r in RECORDS],
    ids=[r[0] for r in RECORDS],
)
def test_foreign_records(tmp_path, previous, previous_ckpt, now, now_ckpt, refused):
    def resolve(raw: dict) -> dict:
        ck = raw.get("checkpoint", {}).get("dir")
        return {**raw, "checkpoint": {"dir": str(tmp_path / ck)}} if ck else raw

    run_dir = tmp_path / "run"
    if previous is not None:
        write_run(run_dir, resolve(previous))
    config = structure_config({**resolve(now), "run": {"dir": str(run_dir)}})
    ckpt = tmp_path / now_ckpt if now_ckpt else run_dir / "checkpoints"
    problem = foreign_records_problem(run_dir, ckpt, config)
    assert (problem is not None) is refused, problem
    if refused:
        assert problem is not None and problem.startswith(f"run.dir: {run_dir}")


def test_metrics_without_a_config_are_an_unknown_runs_records(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    config = structure_config({"run": {"dir": str(tmp_path / "run")}})
    problem = foreign_records_problem(tmp_path / "run", tmp_path / "run" / "checkpoints", config)
    assert problem is not None and "unknown run" in problem


# (reason, step, max_steps, abandoned, fatal)
SAVE_FAILURES = [
    (SaveReason.SCHEDULED, 5, 10, False, False),  # periodic, mid-run: warn and go on
    (SaveReason.SCHEDULED, 10, 10, False, True),  # periodic save of the last step: the last chance
    (SaveReason.FINAL, 10, 10, False, True),
    (SaveReason.FINAL, 7, 10, False, True),  # data exhausted early
    (SaveReason.EMERGENCY, 5, 10, False, True),
    (SaveReason.SCHEDULED, 5, 10, True, True),  # its write still runs: the run ends
]


@pytest.mark.parametrize("reason,step,max_steps,abandoned,fatal", SAVE_FAILURES)
def test_save_failure_is_fatal(reason, step, max_steps, abandoned, fatal):
    assert save_failure_is_fatal(reason, step, max_steps, abandoned) is fatal


# (case, the policy, the streak of dropped steps, words of the ending's sentence)
ABORTS = [
    ("abort at the first non-finite step", NonFinitePolicy.ABORT, 1, "resilience.on_nonfinite = 'abort' ends the run at the first"),
    ("abort: spikes skipped up to the limit", NonFinitePolicy.ABORT, 3, "resilience.max_consecutive_nonfinite=3"),
    ("skip: a streak up to the limit", NonFinitePolicy.SKIP, 3, "3 steps dropped (non-finite or spiking)"),
]  # fmt: skip


@pytest.mark.parametrize("policy,streak,words", [a[1:] for a in ABORTS], ids=[a[0] for a in ABORTS])
def test_a_non_finite_ending_names_the_rule_that_ended_it(policy, streak, words):
    state = LoopState(step=7, nonfinite_streak=streak)
    message = outcome_message(
        LoopOutcome.NAN_ABORT, state, LoopPolicy(max_steps=10, nonfinite_policy=policy), "r"
    )
    assert message is not None and words in message and "step 7" in message


# (case, the step reached, train.max_steps, what the line says of it)
COMPLETE = [
    ("at its max_steps: complete", 100, 100, "is already complete at step 100 (train.max_steps=100)"),
    ("past a lowered max_steps: not called complete", 400, 100, "is at step 400, past train.max_steps=100: nothing to train"),
]  # fmt: skip


@pytest.mark.parametrize(
    "step,max_steps,words", [c[1:] for c in COMPLETE], ids=[c[0] for c in COMPLETE]
)
def test_an_already_complete_run_says_how_to_extend_it(step, max_steps, words):
    message = outcome_message(
        LoopOutcome.ALREADY_COMPLETE,
        LoopState(step=step),
        LoopPolicy(max_steps=max_steps),
        "runs/debug",
    )
    assert message is not None
    assert f"the run in runs/debug {words}; " in message
    assert f"--train.max_steps above {step}" in message and "--run.dir" in message


def test_only_the_outcomes_that_need_a_word_have_one():
    explained = {
        LoopOutcome.ALREADY_COMPLETE,
        LoopOutcome.HEALTH_FAILURE,
        LoopOutcome.REPLAY_MISMATCH,
        LoopOutcome.NAN_ABORT,
        LoopOutcome.FLOAT8_DRIFT,
    }
    assert all(
        outcome_message(o, LoopState(step=5), LoopPolicy(max_steps=10), "r") is None
        for o in set(LoopOutcome) - explained
    )


def test_a_replay_mismatch_says_nothing_of_its_step_was_saved():
    message = outcome_message(
        LoopOutcome.REPLAY_MISMATCH, LoopState(step=3), LoopPolicy(max_steps=10), "runs/debug"
    )
    assert message is not None
    assert (
        "step 3 found no majority" in message
        and "no checkpoint" in message
        and "other hardware" in message
    )


def test_a_health_failure_says_where_the_stacks_are():
    message = outcome_message(
        LoopOutcome.HEALTH_FAILURE, LoopState(step=3), LoopPolicy(max_steps=10), "runs/debug"
    )
    assert message is not None
    assert "after step 3" in message and "runs/debug/stacks/rank<R>.txt" in message


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """DataLoader workers are forked: they must not hold the run after it released it."""
    import os
    import signal

    lock = lock_directories([("run.dir", tmp_path / "run")])
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # the child just lives on, as a worker would
        import time

        os.write(started, b"x")  # after the fork handlers ran
        time.sleep(30)
        os._exit(0)
    os.read(ready, 1)
    try:
        lock.release()
        lock_directories([("run.dir", tmp_path / "run")]).release()  # free although it lives
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


# (case, the state at the abort, words the message has)
NAN_ABORTS = [
    (
        "consecutive dropped steps",
        LoopState(step=8, nonfinite_streak=2, failed_at=8),
        ["2 steps dropped", "past step 8", "max_consecutive_nonfinite=3"],
    ),
    (
        "a step that fails each time the run rolls back to it",
        LoopState(step=6, nonfinite_streak=3, failed_at=6, skipped_ranges=((5, 6), (5, 6))),
        ["3 steps dropped", "past step 6", "failing again each time the run rolled back"],
    ),
]


@pytest.mark.parametrize("state,words", [r[1:] for r in NAN_ABORTS], ids=[r[0] for r in NAN_ABORTS])
def test_a_nan_abort_names_the_step_it_could_not_pass(state, words):
    message = outcome_message(LoopOutcome.NAN_ABORT, state, LoopPolicy(max_steps=10), "r")
    assert message is not None
    assert all(w in message for w in words), message


# (case, what run.dir holds, fault_tolerance.enabled, the refusal's words; None: it starts)
SWITCHES = [
    ("an empty folder, with groups", [], True, None),
    ("an empty folder, without", [], False, None),
    ("a plain run, resumed plainly", ["metrics.jsonl"], False, None),
    ("a plain run, resumed with groups", ["metrics.jsonl"], True, "trained without replica groups"),
    ("a group's run, resumed with groups", ["group_0/metrics.jsonl"], True, None),
    ("groups' runs, resumed plainly", ["group_0/metrics.jsonl", "group_1/metrics.jsonl"], False, "(group_0, group_1)"),
    ("a plain run that logs no metrics, resumed with groups", ["config.toml"], True, "trained without replica groups"),
    ("a group folder with no run in it", ["group_1/notes.txt"], False, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "files,enabled,words", [c[1:] for c in SWITCHES], ids=[c[0] for c in SWITCHES]
)
def test_a_run_dir_trained_with_or_without_replica_groups_is_not_restarted_the_other_way(
    tmp_path, files, enabled, words
):
    for name in files:
        make(tmp_path, f"file:{name}")
    problem = groups_switch_problem(tmp_path, enabled)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith("fault_tolerance.enabled: ")
        assert words in problem and str(tmp_path) in problem
