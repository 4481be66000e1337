"""``torchrun --max-restarts`` brings a 2-rank run back after a rank is killed (gloo, CPU).

torchrun's agent keeps one TCPStore for all its restart rounds; without a per-round prefix the
restarted workers read the dead round's gloo addresses and ``connectFullMesh`` fails
(``forge.parallel.world.restart_namespace``). Here the killed ranks come back, auto-resume
from the newest checkpoint, and log the same losses as a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from forge.parallel.world import restart_namespace, world_info
from tests.conftest import REPO, TINY, once_per_session
from tests.ranks import run_ranks

RUN = [sys.executable, "-m", "torch.distributed.run"]
SCRIPT = str(REPO / "scripts" / "train.py")
ARGS = [
    "--train.max_steps=8",
    "--checkpoint.interval=3",  # synchronous saves (the default) at 3 and 6
    "--data.verify_checksum=false",
    "--distributed.timeout_s=30",
    "--resilience.health_timeout_s=30",
]
# SIGKILL after the save of step 3 on rank 1, then after the save of step 6 on rank 0: each
# restarted round resumes past its fault's step, so no fault fires twice.
TWO_KILLS = "signal:step=3:rank=1:sig=KILL,signal:step=6:rank=0:sig=KILL"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def env_with(faults: str = "", **extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "FORGE_FAULTS": faults, **extra}


def torchrun(config: pathlib.Path, run_dir: pathlib.Path, *launcher: str, faults: str = ""):
    """One agent, two workers, a c10d rendezvous on a free port of this host."""
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}"]
    cmd = [*RUN, "--nproc_per_node=2", *rdzv, *launcher, SCRIPT, str(config),
           f"--run.dir={run_dir}", *ARGS]  # fmt: skip
    start = time.monotonic()
    agent = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(faults)
    )
    stdout, stderr = finish(agent)
    out = subprocess.CompletedProcess(cmd, agent.returncode, stdout, stderr)
    return out, time.monotonic() - start


def finish(agent: subprocess.Popen, timeout: float = 180) -> tuple[str, str]:
    """The agent's output once it ends; past ``timeout``, SIGTERM it, so that it stops its
    workers (each in a session of its own: killing the agent alone would orphan them)."""
    try:
        return agent.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = stop(agent)
        pytest.fail(f"torchrun still running after {timeout} s\n{stdout[-3000:]}{stderr[-5000:]}")


def stop(agent: subprocess.Popen) -> tuple[str, str]:
    agent.terminate()
    try:
        return agent.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        agent.kill()
        return agent.communicate()


def losses(run_dir: pathlib.Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def ok(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus) -> tuple[pathlib.Path, pathlib.Path]:
    """The config, and the run directory of the same 2-rank run, uninterrupted (once per
    session: ``once_per_session``): ranks started without an agent (``tests/ranks.py``), what
    is compared being the ranks' numbers, not torchrun's part."""

    def uninterrupted(tmp: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
        config = tmp / "tiny.toml"
        config.write_text(TINY.format(data=small_corpus))
        ok(run_ranks(2, [SCRIPT, str(config), f"--run.dir={tmp / 'run'}", *ARGS], timeout=180))
        assert [s for s, _ in losses(tmp / "run")] == list(range(1, 9))
        return config, tmp / "run"

    return once_per_session(tmp_path_factory, "torchrun_ref", uninterrupted)


ELASTIC = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize(
    "env,expected",
    [
        (
            {**ELASTIC, "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "2"},
            "forge/restart_2/",
        ),
        ({**ELASTIC, "GROUP_WORLD_SIZE": "1"}, "forge/restart_0/"),
        # several agents count restarts apart: no prefix (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
        ({**ELASTIC, "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}, None),
        # the store is the workers' own (sharing off), or there is no agent at all
        ({**ELASTIC, "TORCHELASTIC_USE_AGENT_STORE": "False", "GROUP_WORLD_SIZE": "1"}, None),
        ({"RANK": "1", "WORLD_SIZE": "2"}, None),
    ],
    ids=["round 2", "first round", "two agents", "sharing off", "no agent"],
)
def test_restart_namespace(env, expected):
    assert restart_namespace(env) == expected
    assert world_info(env).store_prefix == expected


def test_killed_ranks_are_restarted_and_resume_exactly(reference, tmp_path):
    config, ref = reference
    run = tmp_path / "run"
    out, elapsed = torchrun(config, run, "--max-restarts=2", faults=TWO_KILLS)
    ok(out)
    # two failed rounds (the agent names the first worker it saw exit: the killed one, or its
    # peer ending HEALTH_FAILURE), each followed by a resume
    assert out.stderr.count("failed (exitcode: ") == 2, out.stderr[-5000:]
    assert f"resumed from {run}/checkpoints/step_3 at step 3" in out.stderr
    assert f"resumed from {run}/checkpoints/step_6 at step 6" in out.stderr
    assert "connectFullMesh" not in out.stderr
    assert losses(run) == losses(ref)
    assert elapsed < 90, elapsed


def test_several_agents_restart_with_the_store_sharing_off(reference, tmp_path):
    """Two agents (a 2-node rendezvous on one host, one rank each): restart counts are each
    agent's own, so forge adds no prefix; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every
    round a new store, hosted by its rank 0 on a port the rendezvous publishes per round."""
    config, ref = reference
    run = tmp_path / "run"
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--max-restarts=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}", "--rdzv-id=forge-restart-test"]  # fmt: skip
    cmd = [*RUN, *rdzv, SCRIPT, str(config), f"--run.dir={run}", *ARGS]
    env = env_with("signal:step=3:rank=1:sig=KILL", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agents = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    try:
        outs = [finish(agent) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                stop(agent)
    for agent, (stdout, stderr) in zip(agents, outs, strict=True):
        assert agent.returncode == 0, stdout[-3000:] + stderr[-5000:]
    stderr = "".join(e for _, e in outs)
    assert f"resumed from {run}/checkpoints/step_3 at step 3" in stderr
    assert losses(run) == losses(ref)
