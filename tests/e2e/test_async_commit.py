"""An async save commits once every rank has written it, at the next step: a kill between two
saves loses the steps since the last save, not since the one before it."""

from __future__ import annotations

import json

import pytest

from tests.e2e.sandbox import train


@pytest.mark.parametrize("mode", ["async", "async_process"])
def test_a_kill_after_an_async_save_is_written_resumes_from_it(sandbox, mode):
    """Saves at 5 and 10, SIGKILL after step 9: step_5 is committed (it used to wait for the
    save of step 10 to commit, so the run lost everything since step 0)."""
    # steps from 6 on take 1 s more: a tiny step outruns the background write, a loaded
    # machine's write (async_process: another process) may take a second or two
    faults = "slow:step=6:seconds=1,signal:step=9:sig=KILL"
    killed = train(sandbox, f"--checkpoint.async_mode={mode}", env={"FORGE_FAULTS": faults})
    assert killed.code == -9, killed.stderr
    assert (sandbox.ckpt / "step_5" / "train_state.json").is_file()
    assert [json.loads(x)["step"] for x in (sandbox.dir / "checkpoints.jsonl").open()] == [5]
    resumed = train(sandbox, f"--checkpoint.async_mode={mode}")
    assert resumed.code == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "step_5 at step 5" in resumed.stderr
