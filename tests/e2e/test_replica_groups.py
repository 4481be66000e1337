"""Replica groups as users run them (``[fault_tolerance]``, docs/fault-tolerance.md): a
lighthouse, two groups of one process each, one killed mid-run and launched again.

Asserted by events, not timings: the run completes, the relaunched group heals from its live
peer, later steps commit with both groups, every committed step's rows are the row stream's
(the digest of an uninterrupted run's), a NaN injected after the heal is skipped by both groups
as by a run without replica groups, and both groups end with the uninterrupted run's weights.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import time

import pytest
import torch

from forge.checkpoint.store import load_checkpoint
from forge.config import load_config
from forge.model.vlm import build_model
from tests.conftest import REPO, TINY, once_per_session
from tests.e2e.test_train_script import TRAIN
from tests.in_process import run_main
from tests.launched import Launched
from tests.launched import launch as start

pytest.importorskip("torchft")

STEPS = 60
# the lighthouse's info line for each quorum request (torchft 0.2.0's wording, RUST_LOG=info):
# a torchft that words it otherwise fails ``until_asked`` by its timeout, naming the group
ASKED = "Received quorum request for replica"
# the blocks frozen until step 22: the relaunched group (its checkpoint at step 20, frozen)
# heals past the transition, its optimizer's groups put in the peer's stage first
FREEZE = '\n[[freeze]]\nmodule = "layers"\nuntil_step = 22\n'
RUN = [
    f"--train.max_steps={STEPS}",
    "--data.verify_checksum=false",
    "--checkpoint.interval=20",
    "--eval.interval=0",
]


def start_lighthouse(*extra: str, logs: bool = False) -> tuple[Launched, str]:
    """``scripts/lighthouse.py`` on a free port; its address, read from its first line.
    ``logs``: torchft's own info lines on its stderr (each quorum request, ``asked``)."""
    # a group silent for 1 s is left out of the next quorum
    argv = [str(REPO / "scripts" / "lighthouse.py"), "--port=0", "--heartbeat-timeout-ms=1000"]
    lighthouse = start([*argv, *extra], {**os.environ, "RUST_LOG": "info"} if logs else None)
    line = lighthouse.wait_for_output("\n", timeout=60).splitlines()[0]
    assert line.startswith("lighthouse: http://"), line
    return lighthouse, line.split()[1]


def stop(lighthouse: Launched) -> None:
    """SIGTERM, as a user ends it."""
    lighthouse.signal(signal.SIGTERM)
    lighthouse.finish(timeout=10)


def launch(
    config: pathlib.Path,
    run_dir: pathlib.Path,
    group: int,
    lighthouse: str,
    faults: str = "",
    *extra: str,
    fresh: bool = False,
) -> Launched:
    args = [
        str(REPO / "scripts" / "train.py"),
        str(config),
        f"--run.dir={run_dir}",
        *RUN,
        "--fault_tolerance.enabled=true",
        "--fault_tolerance.groups=2",
        f"--fault_tolerance.group={group}",
        f"--fault_tolerance.lighthouse={lighthouse}",
        "--fault_tolerance.timeout_s=10",
        "--fault_tolerance.quorum_timeout_s=30",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "FORGE_FAULTS"}
    if faults:
        env["FORGE_FAULTS"] = faults
    return start(args, env, fresh=fresh)


def finished(launched: Launched, timeout: float = 120) -> tuple[int, str]:
    """Its exit code (killed at ``timeout``) and its output, stdout then stderr."""
    code, out, err = launched.finish(timeout)
    return code, out + err


def records(run_dir: pathlib.Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def weights(
    config: pathlib.Path, run_dir: pathlib.Path, step: int = STEPS
) -> dict[str, torch.Tensor]:
    model = build_model(load_config([str(config)]).config.model)
    load_checkpoint(run_dir / "checkpoints" / f"step_{step}", model, None)
    return model.state_dict()


@pytest.fixture(scope="module")
def killed_and_healed(tmp_path_factory, small_corpus):
    """Group 1 kills itself after step 20 and is launched again once group 0 has trained a
    step alone, healing past the freeze schedule's transition at step 22; a NaN at step 55 in
    group 0 only, after the heal: group 0 waits after step 50 until the relaunched group has
    asked the lighthouse for a quorum (which forms with both: the lighthouse refuses a quorum
    of one of two live groups), by events, not by a race between the relaunch's start-up and
    the steps group 0 trains alone.
    Beside it, the same run without replica groups, in one process (the reference). Once per
    session (``once_per_session``)."""
    return once_per_session(
        tmp_path_factory, "ft_killed_and_healed", lambda tmp: kill_and_heal(tmp, small_corpus)
    )


def kill_and_heal(
    tmp: pathlib.Path, small_corpus: pathlib.Path
) -> tuple[pathlib.Path, pathlib.Path, tuple[tuple[int, str], tuple[int, str]]]:
    config = tmp / "tiny.toml"
    config.write_text(TINY.format(data=small_corpus) + FREEZE)
    lighthouse, address = start_lighthouse(logs=True)
    release = tmp / "release"
    try:
        held = f"stall:step=50:until={release}:seconds=600,nan:step=55"  # past until_asked's wait
        first = launch(config, tmp / "run", 0, address, held)
        doomed = launch(config, tmp / "run", 1, address, "signal:step=20:sig=KILL")
        killed = finished(doomed)
        assert killed[0] == -signal.SIGKILL, killed[1][-3000:]
        # relaunched once group 0 has committed a step alone (by events, not a delay: a
        # collective with a peer that died before it connected waits fault_tolerance.timeout_s)
        until_alone(tmp / "run" / "group_0", after=20)
        before = asked(lighthouse, "group_1")
        # a fresh interpreter (its own string-hash seed, unlike forks of the warm one): the
        # heal crosses two interpreters that share nothing
        second = launch(config, tmp / "run", 1, address, fresh=True)
        until_asked(lighthouse, "group_1", more_than=before, peer=second)
        release.touch()
        outcomes = finished(first), finished(second)
    finally:
        stop(lighthouse)
    os.environ["FORGE_FAULTS"] = "nan:step=55"
    try:
        out = run_main(
            TRAIN.main,
            [str(config), f"--run.dir={tmp / 'ref'}", *RUN, "--train.grad_accum_steps=2"],
        )
    finally:
        del os.environ["FORGE_FAULTS"]
    assert out.returncode == 0, out.stderr[-3000:]
    return config, tmp, outcomes


def test_both_groups_complete_and_the_relaunched_one_heals_from_its_peer(killed_and_healed):
    _, tmp, ((code0, log0), (code1, log1)) = killed_and_healed
    assert code0 == 0, log0[-4000:]
    assert code1 == 0, log1[-4000:]
    assert f"COMPLETED at step {STEPS}" in log0 and f"COMPLETED at step {STEPS}" in log1
    assert "healed from a live peer at step" in log1
    healed = records(tmp / "run" / "group_1")
    # (group 1 may also have healed at its first launch, had group 0 started first)
    assert any(20 < s < STEPS for s, r in healed.items() if "ft/heal_s" in r)


def test_group_0_trains_alone_while_its_peer_is_down_then_with_it(killed_and_healed):
    _, tmp, _ = killed_and_healed
    seen = {s: r["ft/participants"] for s, r in records(tmp / "run" / "group_0").items()}
    alone = sorted(s for s, p in seen.items() if p == 1 and s > 20)
    assert alone, "no step after the kill ran with one group"
    assert all(seen[s] == 2 for s in range(alone[-1] + 1, STEPS + 1))  # both, once healed
    assert seen[20] == 2  # both before the kill


def test_every_committed_step_reads_the_uninterrupted_runs_rows(killed_and_healed):
    _, tmp, _ = killed_and_healed
    reference = records(tmp / "ref")
    for group in ("group_0", "group_1"):
        for step, record in records(tmp / "run" / group).items():
            assert record["data/rows"] == reference[step]["data/rows"], (group, step)
            assert record["data/rows_digest"] == reference[step]["data/rows_digest"], (group, step)
            assert record["tokens_seen"] == reference[step]["tokens_seen"], (group, step)


def test_a_nan_after_the_heal_is_skipped_by_both_groups_as_without_replica_groups(
    killed_and_healed,
):
    _, tmp, _ = killed_and_healed
    assert math.isnan(records(tmp / "ref")[55]["loss"])  # the reference skipped it too
    for group in ("group_0", "group_1"):  # the NaN was group 0's: the sum carried it to both
        assert math.isnan(records(tmp / "run" / group)[55]["loss"]), group
        assert math.isfinite(records(tmp / "run" / group)[56]["loss"]), group


def test_both_groups_end_with_the_uninterrupted_runs_weights(killed_and_healed):
    config, tmp, _ = killed_and_healed
    reference = weights(config, tmp / "ref")
    for group in ("group_0", "group_1"):
        trained = weights(config, tmp / "run" / group)
        for name, tensor in reference.items():
            assert torch.equal(trained[name], tensor), (group, name)


def test_both_groups_hold_the_same_checkpoint_optimizer_state_included(killed_and_healed):
    _, tmp, _ = killed_and_healed
    ours, theirs = (
        tmp / "run" / g / "checkpoints" / f"step_{STEPS}" for g in ("group_0", "group_1")
    )
    shards = sorted(p.name for p in ours.glob("*.distcp"))
    assert shards and shards == sorted(p.name for p in theirs.glob("*.distcp"))
    for name in shards:  # every tensor, the model's and the optimizer's, byte for byte
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_losing_every_group_at_once_resumes_from_the_checkpoints_as_without_them(
    killed_and_healed,
):
    """Both groups stopped by SIGTERM after step 30 (each saves and exits 75), then both
    launched again: they resume from their own checkpoints and end with the uninterrupted
    run's weights (the reference of the module's fixture, its NaN at step 55 included)."""
    config, tmp, _ = killed_and_healed
    # a quorum of both: else the group that starts first (its start-up 1 s ahead of the other's
    # on a loaded machine, the lighthouse's join timeout) trains a step alone, as documented
    lighthouse, address = start_lighthouse("--min-groups=2")
    run_dir = tmp / "all_lost"
    try:
        stopped = [
            launch(config, run_dir, 0, address, "signal:step=30:sig=TERM,nan:step=55"),
            launch(config, run_dir, 1, address, "signal:step=30:sig=TERM"),
        ]
        for code, log in map(finished, stopped):
            assert code == 75, log[-3000:]
        again = [
            launch(config, run_dir, 0, address, "nan:step=55"),
            launch(config, run_dir, 1, address),
        ]
        for code, log in map(finished, again):
            assert code == 0, log[-3000:]
            assert "resumed from" in log
    finally:
        stop(lighthouse)
    reference = weights(config, tmp / "ref")
    for group in ("group_0", "group_1"):
        trained = weights(config, run_dir / group)
        for name, tensor in reference.items():
            assert torch.equal(trained[name], tensor), (group, name)


def test_a_group_with_another_layout_is_refused_and_the_others_go_on(tmp_path, small_corpus):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(data=small_corpus))
    lighthouse, address = start_lighthouse()
    short = "--fault_tolerance.timeout_s=4"  # the refused group's share of a step times out
    try:
        running = launch(config, tmp_path / "run", 0, address, "slow:step=1:seconds=0.2", short)
        until_step(tmp_path / "run" / "group_0", 3)
        other = launch(config, tmp_path / "run", 1, address, "", short, "--train.batch_size=2")
        code, log = finished(other)
        reached = max(records(tmp_path / "run" / "group_0"))
        until_step(tmp_path / "run" / "group_0", reached + 2)  # it goes on without the other
        running.signal(signal.SIGTERM)
        outcome = finished(running)
    finally:
        stop(lighthouse)
    lines = [line for line in log.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, log[-3000:]
    assert "layout, model, batch or LR schedule in force is not the other groups'" in lines[0]
    assert "Traceback" not in log
    assert not (tmp_path / "run" / "group_1").exists()  # nothing written
    assert outcome[0] == 75, outcome[1][-3000:]  # alive until told to stop: it saved and left


def test_groups_resumed_under_different_lr_schedules_stop_at_their_first_step(
    tmp_path, small_corpus
):
    """Both groups trained to step 4, then launched again to step 6: group 0 keeps its
    checkpoint's LR schedule (``checkpoint.schedule_from``, each group's own), group 1 takes
    the config's. Neither is behind, so no heal settles it: the first step's sums compare the
    schedule in force and both stop, exit 2, instead of applying other learning rates to one
    model (each saves nothing past step 4)."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(data=small_corpus))
    lighthouse, address = start_lighthouse("--min-groups=2")
    run_dir = tmp_path / "run"
    short = ["--train.max_steps=4", "--scheduler.warmup_steps=1"]
    try:
        for code, log in map(
            finished, [launch(config, run_dir, g, address, "", *short) for g in (0, 1)]
        ):
            assert code == 0, log[-3000:]
        longer = ["--train.max_steps=6", "--scheduler.warmup_steps=1"]
        again = [
            launch(
                config, run_dir, 0, address, "", *longer, "--checkpoint.schedule_from=checkpoint"
            ),
            launch(config, run_dir, 1, address, "", *longer, "--checkpoint.schedule_from=config"),
        ]
        outcomes = [finished(proc) for proc in again]
    finally:
        stop(lighthouse)
    for code, log in outcomes:
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1, log[-3000:]
        assert "LR schedule in force is not the other groups'" in errors[0]
    for group in ("group_0", "group_1"):
        assert max(records(run_dir / group)) == 4
        assert not (run_dir / group / "checkpoints" / "step_5").exists()


def until_alone(run_dir: pathlib.Path, after: int, timeout: float = 120) -> None:
    """Until ``run_dir``'s group logs a step past ``after`` that it ran alone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and any(
            s > after and r.get("ft/participants") == 1 for s, r in records(run_dir).items()
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"{run_dir} never ran a step alone after step {after}")


def asked(lighthouse: Launched, group: str) -> int:
    """How often ``group`` has asked ``lighthouse`` (started with ``logs``) for a quorum."""
    return lighthouse.stderr().count(f"{ASKED} {group}")


def until_asked(
    lighthouse: Launched, group: str, more_than: int, peer: Launched, timeout: float = 120
) -> None:
    """Until ``group`` (the process ``peer``) has asked for a quorum more than ``more_than``
    times."""
    deadline = time.monotonic() + timeout
    while asked(lighthouse, group) <= more_than:
        assert peer.poll() is None, f"{group} ended before asking for a quorum: {peer.stderr()}"
        assert time.monotonic() < deadline, f"{group} never asked for a quorum ({ASKED!r})"
        time.sleep(0.1)


def until_step(run_dir: pathlib.Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and any(s >= step for s in records(run_dir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{run_dir} never reached step {step}")


def test_a_group_that_finds_no_quorum_at_set_up_exits_4_writing_nothing(tmp_path, small_corpus):
    """A lighthouse that needs two groups and one started: retryable (a scheduler may start
    the other later), so exit 4 and not 2, one line, nothing written."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(data=small_corpus))
    lighthouse, address = start_lighthouse("--min-groups=2")
    try:
        alone = launch(
            config, tmp_path / "run", 0, address, "", "--fault_tolerance.quorum_timeout_s=2"
        )
        code, log = finished(alone)
    finally:
        stop(lighthouse)
    lines = [line for line in log.splitlines() if line.startswith("error:")]
    assert code == 4 and len(lines) == 1, log[-3000:]
    assert "quorum_timeout_s=2" in lines[0] and "--min-groups" in lines[0]
    assert "Traceback" not in log and "metadata" not in log
    assert not (tmp_path / "run" / "group_0").exists()
