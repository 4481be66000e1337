"""``scripts/eval_follow.py``: a follower evaluates every committed checkpoint beside the
training and gives in-loop evaluation's numbers for the same step; against a retention that
keeps one step it never reads a step being removed and records the removed ones as skipped;
killed (follower mid-read, trainer mid-save) and restarted, every step is recorded exactly
once; object-store checkpoints work alike; a second follower is refused; a signal ends it in
one line with nothing half-recorded."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import signal
import subprocess
import threading
import time

import pytest

from forge.training.evaluation.follow import INCOMPLETE, LOSS, REMOVED, RESULTS_FILE
from tests.conftest import REPO
from tests.e2e.sandbox import Run, copy_trained, make_run, train_here
from tests.e2e.test_downstream_tasks import TASKS
from tests.e2e.test_train_script import load_script
from tests.in_process import run_main
from tests.launched import Launched, launch
from tests.ranks import run_ranks

FOLLOW = load_script("eval_follow")
SCRIPT = str(REPO / "scripts" / "eval_follow.py")
TRAIN = str(REPO / "scripts" / "train.py")


def configured(run: Run, *, ck: int, keep: int, every: int, steps: int, extra: str = "") -> Run:
    """``run``'s config saving every ``ck`` steps, keeping ``keep``, evaluating in the loop
    every ``every`` steps (3 held-out batches), ``steps`` steps in all."""
    text = run.config.read_text()
    text = text.replace("[checkpoint]\n", f"[checkpoint]\nkeep_last_n = {keep}\n")
    text = text.replace("interval = 5", f"interval = {ck}").replace(
        "max_steps = 12", f"max_steps = {steps}"
    )
    run.config.write_text(text + f"\n[eval]\ninterval = {every}\nsteps = 3\n{extra}")
    return run


def follow(run: Run, *args: str) -> subprocess.CompletedProcess:
    return run_main(FOLLOW.main, [str(run.dir), "--poll-s", "0.02", *args])


def results(run: Run) -> list[dict]:
    path = run.dir / RESULTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


def in_loop(run: Run) -> dict[int, dict]:
    """Each step's in-loop evaluation record (the held-out loss, task scores merged)."""
    out: dict[int, dict] = collections.defaultdict(dict)
    for line in (run.dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if any(k.startswith("eval/") for k in record):
            out[record["step"]] |= record
    return out


def start(argv: list[str], env: dict[str, str] | None = None) -> Launched:
    return launch(argv, {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def wait_for(predicate, what: str, timeout: float = 120.0, every: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def once_each(records: list[dict], what: str = LOSS) -> dict[int, dict]:
    """The records of ``what`` by step, each step recorded exactly once."""
    counts = collections.Counter(r["step"] for r in records if r["what"] == what)
    assert all(n == 1 for n in counts.values()), counts
    return {r["step"]: r for r in records if r["what"] == what}


def test_the_follower_gives_in_loop_evaluation_s_loss_and_scores(tmp_path, small_corpus):
    tasks = f'\n[[eval.tasks]]\nname = "stdlib_line_order"\ninclude_path = "{TASKS}"\nlimit = 8\n'
    run = configured(make_run(tmp_path, small_corpus), ck=3, keep=0, every=3, steps=6, extra=tasks)
    assert train_here(run, "--metrics.tensorboard=true").code == 0
    done = follow(run)
    assert done.returncode == 0, done.stderr
    assert "done: the run completed; 2 step(s) evaluated" in done.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.dir / "tensorboard" / "eval_follow"))  # beside the run's
    events.Reload()
    assert all(tag.startswith("eval/") for tag in events.Tags()["scalars"])  # no time, no what
    shown = {e.step: e.value for e in events.Scalars("eval/loss")}
    assert shown == {s: pytest.approx(r["eval/loss"]) for s, r in in_loop(run).items()}
    mine, loop = results(run), in_loop(run)
    assert sorted(once_each(mine)) == [3, 6]
    for r in mine:  # the same floats: the same rows, weights and precision, one rank each
        expected = {k: v for k, v in loop[r["step"]].items() if k.startswith("eval/")}
        got = {k: v for k, v in r.items() if k.startswith("eval/") and k != "eval/tokens"}
        assert got and got.items() <= expected.items(), (got, expected)
    assert {r["what"] for r in mine} == {LOSS, "stdlib_line_order"}


def test_a_two_rank_trainer_s_rows_at_one_and_two_follower_ranks(tmp_path, small_corpus):
    run = configured(make_run(tmp_path, small_corpus), ck=4, keep=0, every=4, steps=4)
    trained = run_ranks(2, [TRAIN, str(run.config)])
    assert trained.returncode == 0, trained.stderr
    expected = in_loop(run)[4]["eval/loss"]  # two data-parallel ranks' rows
    one = follow(run)
    assert one.returncode == 0, one.stderr
    assert once_each(results(run))[4]["eval/loss"] == pytest.approx(expected, rel=1e-6)
    (run.dir / RESULTS_FILE).unlink()
    two = run_ranks(2, [SCRIPT, str(run.dir), "--poll-s", "0.02"])
    assert two.returncode == 0, two.stderr
    assert once_each(results(run))[4]["eval/loss"] == pytest.approx(expected, rel=1e-6)


def test_beside_a_retention_of_one_step_nothing_is_read_while_removed(tmp_path, small_corpus):
    run = configured(make_run(tmp_path, small_corpus), ck=1, keep=1, every=1, steps=40)
    slow = {"FORGE_FAULTS": "slow:step=1:seconds=0.05"}  # ~60 ms a step: the follower keeps up
    trainer = start([TRAIN, str(run.config)], env=slow)
    wait_for(lambda: (run.dir / "config.toml").is_file(), "the trainer's start")
    follower = start([SCRIPT, str(run.dir), "--poll-s", "0.01"])
    code, _, err = trainer.finish()
    assert code == 0, err
    code, _, err = follower.finish()
    assert code == 0, err
    mine = once_each(results(run))
    assert sorted(mine) == list(range(1, 41))  # every committed step has its record
    assert not [r for r in mine.values() if "could not be read" in r.get("skipped", "")]
    evaluated = {s: r for s, r in mine.items() if "eval/loss" in r}
    skipped = {s for s, r in mine.items() if r.get("skipped") == REMOVED}
    assert set(evaluated) | skipped == set(range(1, 41)) and 40 in evaluated
    assert len(evaluated) > 1, err  # it read steps while the trainer ran, not the last alone
    loop = in_loop(run)
    assert all(r["eval/loss"] == loop[s]["eval/loss"] for s, r in evaluated.items())
    pins = run.ckpt / "pins"
    assert not pins.exists()  # no pin, no marker left behind: the folder went with the last
    assert sorted(p.name for p in run.ckpt.glob("step_*")) == ["step_40"]


def test_killed_follower_and_trainer_restarted_record_every_step_once(tmp_path, small_corpus):
    run = configured(make_run(tmp_path, small_corpus), ck=2, keep=1, every=2, steps=40)
    config = [TRAIN, str(run.config), "--checkpoint.async_mode=async"]
    slow = "slow:step=1:seconds=0.05"
    # the trainer SIGKILLs itself right after step 20's save starts (async: not committed)
    trainer = start(config, env={"FORGE_FAULTS": f"{slow},signal:step=20:sig=KILL"})
    wait_for(lambda: (run.dir / "config.toml").is_file(), "the trainer's start")
    follower = start([SCRIPT, str(run.dir), "--poll-s", "0.01"])
    pins = run.ckpt / "pins"
    # SIGKILL the follower while it holds a pin (in the middle of reading a step) if this
    # process sees one in time on a busy machine; else wherever it is, a result recorded
    caught = True
    try:
        wait_for(lambda: pins.is_dir() and any(pins.glob("*.pin")), "a pin", 30, 0.0005)
    except AssertionError:
        caught = False
    follower.kill()
    left = [p.name for p in pins.glob("*.pin")]
    follower = start([SCRIPT, str(run.dir), "--poll-s", "0.01"])
    assert trainer.finish()[0] == -signal.SIGKILL
    assert (run.ckpt / "step_20.tmp").is_dir()  # killed with its save in flight
    trainer = start(config, env={"FORGE_FAULTS": slow})  # resumes from the newest committed
    code, _, err = trainer.finish()
    assert code == 0, err
    code, _, err = follower.finish()
    assert code == 0, err
    mine = once_each(results(run))
    assert sorted(mine) == list(range(2, 41, 2))
    evaluated = {s: r for s, r in mine.items() if "eval/loss" in r}
    loop = in_loop(run)  # a resumed run's records: the steps after its checkpoint are redone
    assert all(r["eval/loss"] == pytest.approx(loop[s]["eval/loss"]) for s, r in evaluated.items())
    assert not list(pins.glob("*.pin"))  # the killed follower's pin, if any, was reclaimed
    assert bool(left) or not caught
    assert sorted(p.name for p in run.ckpt.glob("step_*")) == ["step_40"]


def test_object_store_checkpoints_are_followed_alike(tmp_path, small_corpus, s3_bucket):
    run = configured(make_run(tmp_path, small_corpus), ck=3, keep=1, every=3, steps=6)
    url = f"s3://{s3_bucket}/follow"
    assert train_here(run, f"--checkpoint.dir={url}").code == 0
    done = follow(run)
    assert done.returncode == 0, done.stderr
    mine = once_each(results(run))
    assert mine[3]["skipped"] == REMOVED  # keep_last_n = 1 removed it before the follower came
    assert mine[6]["eval/loss"] == in_loop(run)[6]["eval/loss"]
    assert mine[6]["checkpoint"] == f"{url}/step_6"


def test_a_second_follower_is_refused_and_a_signal_ends_the_first(tmp_path, small_corpus):
    run = configured(make_run(tmp_path, small_corpus), ck=3, keep=0, every=3, steps=6)
    assert train_here(run).code == 0
    config = run.dir / "config.toml"  # the run is to go on to step 12: the follower waits
    config.write_text(config.read_text().replace("max_steps = 6", "max_steps = 12"))
    first = start([SCRIPT, str(run.dir), "--poll-s", "0.05"])
    wait_for(lambda: (run.dir / RESULTS_FILE).is_file() and len(results(run)) == 2, "2 steps")
    second = follow(run)
    assert second.returncode == 2
    assert second.stderr.startswith("error:") and "already followed by pid" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    first.signal(signal.SIGTERM)
    code, _, err = first.finish(timeout=60)
    assert code == 130, err
    assert err.strip().splitlines()[-1].startswith("interrupted (SIGTERM)")
    assert "Traceback" not in err and len(results(run)) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--every", "0"], "--every: must be >= 1"),
        (["--poll-s", "0"], "--poll-s: must be > 0"),
        (["--pin-ttl-s", "0.5"], "--pin-ttl-s: must be >= 1"),
        (["--tasks", "no_such_task_anywhere", "--include-path", str(TASKS)], "no_such_task"),
        (["--start-timeout-s", "0"], "no config.toml after 0 s"),
    ],
)
def test_bad_options_and_a_missing_run_are_one_line_each(tmp_path, args, message):
    done = run_main(FOLLOW.main, [str(tmp_path / "no_run"), *args])
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_file_is_not_a_run(tmp_path):
    path = pathlib.Path(tmp_path / "f")
    path.write_text("x")
    done = run_main(FOLLOW.main, [str(path)])
    assert done.returncode == 2 and "a file, not a run directory" in done.stderr


def copied(trained: Run, sandbox: Run, **config: str) -> Run:
    """The trained run copied into the sandbox, its recorded config's keys replaced."""
    copy_trained(trained, sandbox)
    path = sandbox.dir / "config.toml"
    text = path.read_text()
    for key, value in config.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    path.write_text(text)
    return sandbox


@pytest.mark.parametrize(
    ("change", "args", "message"),
    [
        ({"path": '"/nonexistent/data"'}, [], "/nonexistent/data"),
        ({"eval_split": '"dev"'}, [], "no split 'dev' to evaluate on"),
        ({}, ["--no-loss"], "nothing to evaluate"),
    ],
)
def test_a_run_the_follower_cannot_evaluate_is_one_line(trained, sandbox, change, args, message):
    run = copied(trained, sandbox, **change)
    done = follow(run, *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (run.dir / RESULTS_FILE).exists()


def test_a_record_it_cannot_write_is_one_line_and_nothing_else(trained, sandbox):
    run = copied(trained, sandbox)
    (run.dir / RESULTS_FILE).mkdir()  # in the way of the follower's record
    done = follow(run)
    assert done.returncode == 2, done.stderr
    assert "eval_follow.jsonl: cannot be written" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_followed_run_trains_alike_without_evaluating_and_says_so(tmp_path, small_corpus):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    looped = configured(make_run(tmp_path / "a", small_corpus), ck=3, keep=0, every=3, steps=6)
    followed = configured(make_run(tmp_path / "b", small_corpus), ck=3, keep=0, every=3, steps=6)
    assert train_here(looped).code == 0
    done = train_here(followed, "--eval.follow=true")
    assert done.code == 0, done.stderr
    assert f"eval_follow.py {followed.dir}" in done.stderr
    assert in_loop(followed) == {}  # nothing evaluated in the loop
    assert follow(followed).returncode == 0
    mine = once_each(results(followed))
    assert {s: r["eval/loss"] for s, r in mine.items()} == {
        s: r["eval/loss"] for s, r in in_loop(looped).items()
    }


def test_an_incomplete_checkpoint_is_recorded_as_unreadable_not_removed(trained, sandbox):
    run = copied(trained, sandbox)
    (run.ckpt / "step_5" / ".metadata").unlink()  # damaged in place: still there
    done = follow(run, "--every", "5")
    assert done.returncode == 0, done.stderr
    mine = once_each(results(run))
    assert mine[5]["skipped"] == INCOMPLETE and "eval/loss" in mine[10]


def test_a_damaged_checkpoint_is_recorded_as_not_loading_by_its_own_path(trained, sandbox):
    run = copied(trained, sandbox)
    rng = next((run.ckpt / "step_5").glob("rng_rank*.pt"))
    rng.write_bytes(rng.read_bytes()[:10])  # complete, but a file of it is cut short
    done = follow(run, "--every", "5")
    assert done.returncode == 0, done.stderr
    mine = once_each(results(run))
    reason = mine[5]["skipped"]  # why, once: no hint of what to name on a command line
    assert reason.startswith("the checkpoint could not be read: ") and rng.name in reason
    assert "does not load" not in reason and "checkpoint.dir" not in reason
    assert "eval/loss" in mine[10]


def test_a_run_a_trainer_holds_is_not_done_until_it_lets_go(trained, sandbox):
    import fcntl

    run = copied(trained, sandbox)
    lock = (run.dir / ".forge.lock").open("a+")
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # a trainer resuming the run, maybe further
    follower = start([SCRIPT, str(run.dir), "--poll-s", "0.05"])
    try:
        wait_for(lambda: len(results(run)) == 2 if (run.dir / RESULTS_FILE).exists() else False,
                 "both steps")  # fmt: skip
        time.sleep(0.5)
        assert follower.poll() is None  # every step done, but the trainer may go on
    finally:
        lock.close()
    code, _, err = follower.finish(timeout=60)
    assert code == 0 and "done: the run completed" in err


def test_a_failure_of_rank_0_ends_every_follower_rank_in_one_line(trained, sandbox):
    run = copied(trained, sandbox)
    config = run.dir / "config.toml"
    config.write_text(config.read_text().replace("max_steps = 10", "max_steps = 20"))
    followers: list[subprocess.CompletedProcess[str]] = []  # two ranks, beside this thread
    ranks = threading.Thread(target=lambda: followers.append(
        run_ranks(2, [SCRIPT, str(run.dir), "--poll-s", "0.05"], timeout=120)))  # fmt: skip
    ranks.start()
    try:
        wait_for(lambda: (run.dir / RESULTS_FILE).exists() and len(results(run)) == 2, "2 steps")
        config.write_text("[model\n")  # the run's config, damaged while it is followed
    finally:
        ranks.join()
    (done,) = followers
    err = done.stderr
    assert done.returncode == 2, err
    assert "error:" in err and "Traceback" not in err


def test_the_follower_s_wandb_run_is_its_own_beside_the_trainer_s(
    tmp_path, small_corpus, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = configured(make_run(tmp_path, small_corpus), ck=3, keep=0, every=3, steps=6)
    assert train_here(run, "--metrics.wandb=true").code == 0
    assert follow(run).returncode == 0
    trainer = (run.dir / "wandb_run_id").read_text().strip()
    mine = (run.dir / "wandb_eval_follow_run_id").read_text().strip()
    assert mine and mine != trainer  # a W&B run takes one writer: the follower has its own
    folders = {f.name.rsplit("-", 1)[-1] for f in (run.dir / "wandb").glob("offline-run-*")}
    assert {trainer, mine} <= folders
