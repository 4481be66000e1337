"""Faults that land on a save, each in real processes: a signal to the whole process group
(a terminal's Ctrl-C, torchrun's shutdown), a peer killed while a save is in flight."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from forge.checkpoint.paths import CheckpointPath, location
from forge.checkpoint.store import latest_step, load_checkpoint, read_train_state, step_dir
from forge.config import load_config
from forge.model.transformer import Transformer
from tests.conftest import REPO
from tests.e2e.sandbox import TRAIN, Run
from tests.ranks import every_exit_code
from tests.zygote import end_group, read, start_script

MODES = ["disabled", "async", "async_process"]
# a save at every step: whenever the signal lands, one is in flight or awaiting its commit
SAVES = ["--train.max_steps=200", "--checkpoint.interval=1", "--data.verify_checksum=false"]


def logged_steps(run_dir: pathlib.Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def wait_for_steps(run_dir: pathlib.Path, steps: int, *procs) -> None:
    """Until ``steps`` records are logged (training has started and saved)."""
    deadline = time.monotonic() + 120
    while logged_steps(run_dir) < steps:
        assert all(p.poll() is None for p in procs), "the run ended before it was signalled"
        assert time.monotonic() < deadline, "no steps logged within 120 s"
        time.sleep(0.05)


def emergency_step(config: pathlib.Path, ckpt: CheckpointPath, ranks: int) -> int:
    """The step ``latest`` names: an emergency save of every rank, that loads."""
    step = latest_step(ckpt)
    assert step is not None, f"no latest in {ckpt}"
    latest = step_dir(ckpt, step)
    state = read_train_state(latest)
    assert state["reason"] == "emergency", state["reason"]
    assert sorted(p.name for p in latest.glob("rng_rank*.pt")) == [
        f"rng_rank{r}.pt" for r in range(ranks)
    ]
    model = Transformer(load_config([str(config)]).config.model)
    load_checkpoint(latest, model, None)
    return step


def checkpoints(
    request: pytest.FixtureRequest, run: Run, store: str
) -> tuple[CheckpointPath, list]:
    """Where the run saves: its own folder, or a new bucket of the tests' S3 endpoint; and the
    argument that says so."""
    if store == "disk":
        return run.ckpt, []
    url = f"s3://{request.getfixturevalue('s3_bucket')}/run"
    return location(url), [f"--checkpoint.dir={url}"]


# one process: a terminal's Ctrl-C (SIGINT) or a scheduler's SIGTERM to the whole group
GROUP_SIGNALS = [
    ("disabled", signal.SIGTERM, "disk"),
    ("async", signal.SIGINT, "disk"),
    ("async_process", signal.SIGTERM, "s3"),
    ("async_process", signal.SIGINT, "disk"),
]


@pytest.mark.parametrize("mode,sig,store", GROUP_SIGNALS, ids=lambda v: getattr(v, "name", v))
def test_a_signal_to_the_process_group_saves_an_emergency_checkpoint(
    request, sandbox: Run, mode, sig, store
):
    """The signal reaches every process of the run's group (the checkpoint process of
    ``async_process`` is not one of them): exit 75, every save committed, and an emergency
    checkpoint that loads."""
    ckpt, where = checkpoints(request, sandbox, store)
    out, err = sandbox.root / "stdout", sandbox.root / "stderr"
    out.touch()
    err.touch()
    argv = [*TRAIN[1:], str(sandbox.config), *SAVES, *where, f"--checkpoint.async_mode={mode}"]
    proc = start_script(argv, str(out), str(err))  # a session of its own, as from a shell
    try:
        wait_for_steps(sandbox.dir, 2, proc)
        os.killpg(proc.pid, sig)
        code = proc.wait(120)
    finally:
        end_group(proc)
    stderr = read(str(err)).decode()
    assert code == 75, stderr[-3000:]
    assert "Traceback" not in stderr and "failed" not in stderr, stderr[-3000:]
    emergency_step(sandbox.config, ckpt, ranks=1)


def torchrun(config: pathlib.Path, run_dir: pathlib.Path, exits: pathlib.Path, *args: str):
    """torchrun's agent and two workers, each worker's exit code written into ``exits``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "e2e" / "exit_status.py"), str(REPO / "scripts" / "train.py"),
           str(config), f"--run.dir={run_dir}", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FORGE_TEST_EXIT_DIR": str(exits)}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_torchrun_shutdown_saves_an_emergency_checkpoint_on_both_ranks(sandbox: Run, mode):
    """SIGTERM to torchrun, which sends it to each worker's process group: both ranks make
    the emergency save and exit 75."""
    exits = sandbox.root / "exits"
    exits.mkdir()
    agent = torchrun(sandbox.config, sandbox.dir, exits, *SAVES, f"--checkpoint.async_mode={mode}")
    try:
        wait_for_steps(sandbox.dir, 2, agent)
        agent.send_signal(signal.SIGTERM)
        stdout, stderr = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    codes = [(exits / f"rank{r}").read_text() for r in range(2)]
    assert codes == ["75", "75"], stdout[-2000:] + stderr[-4000:]
    assert "failed (" not in stderr and "BrokenPipe" not in stderr, stderr[-4000:]
    emergency_step(sandbox.config, sandbox.ckpt, ranks=2)


TWO_RANKS = [
    "--distributed.dp_shard=2",
    "--train.batch_size=2",
    "--distributed.timeout_s=30",
    "--resilience.health_timeout_s=30",
    "--data.verify_checksum=false",
    "--checkpoint.interval=3",
]
# rank 1 is SIGKILLed at the end of a step: after step 3, whose save (every 3 steps) is then
# in flight in the async modes (the survivor's next step fails, then the save's wait); or
# after the last step, 4, off the schedule (the survivor is inside the final save's
# collectives when it finds its peer gone)
KILLED_IN_FLIGHT = ("signal:step=3:rank=1:sig=KILL", "--train.max_steps=6")
KILLED_BEFORE_FINAL = ("signal:step=4:rank=1:sig=KILL", "--train.max_steps=4")


@pytest.mark.parametrize(
    "mode,kill,store",
    [
        ("disabled", KILLED_BEFORE_FINAL, "disk"),
        ("async", KILLED_IN_FLIGHT, "s3"),
        ("async_process", KILLED_IN_FLIGHT, "disk"),
    ],
    ids=["disabled-final-save", "async-in-flight-s3", "async_process-in-flight"],
)
def test_a_peer_killed_during_a_save_ends_health_failure_in_one_line(
    request, sandbox: Run, mode, kill, store
):
    faults, steps = kill
    _, where = checkpoints(request, sandbox, store)
    argv = [str(REPO / "scripts" / "train.py"), str(sandbox.config), *TWO_RANKS, steps, *where,
            f"--checkpoint.async_mode={mode}"]  # fmt: skip
    codes, stdout, stderr = every_exit_code(2, argv, env={"FORGE_FAULTS": faults})
    assert codes == [4, -signal.SIGKILL], stderr[-4000:]  # the survivor: HEALTH_FAILURE
    assert "Traceback" not in stderr, stderr[-4000:]
    lines = [x for x in stderr.splitlines() if "error:" in x]
    assert len(lines) == 1 and lines[0].startswith("[forge] error: rank 0: "), stderr[-4000:]
    assert "a peer is stalled or dead" in lines[0] and "the run ends HEALTH_FAILURE" in lines[0]
    assert "HEALTH_FAILURE at step" in stdout, stdout[-2000:]
    if mode == "async_process":  # the killed rank's checkpoint process did not outlive it
        log = (sandbox.dir / "checkpoint_process_rank1.log").read_text()
        pid = int(log.split("[forge] checkpoint process ")[1].split()[0])
        assert gone_within(pid, 5.0), f"checkpoint process {pid} outlived its rank"


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` has ended (or is a zombie nobody reaped) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
