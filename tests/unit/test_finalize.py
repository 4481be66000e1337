"""The final-save decision, one row per case, with no torch anywhere."""

import subprocess
import sys

import pytest

from forge.training.finalize import CheckpointView, FinalSaveReason, finalize
from forge.training.outcome import LoopOutcome

R = FinalSaveReason

# (case, outcome, step, max_steps, last_saved, last_finite, enabled, save_step, reason)
CASES = [
    ("clean finish off-schedule", LoopOutcome.COMPLETED, 10, 10, 8, True, True, 10, R.CLEAN_FINISH),
    (
        "clean finish never saved",
        LoopOutcome.COMPLETED,
        10,
        10,
        None,
        True,
        True,
        10,
        R.CLEAN_FINISH,
    ),
    (
        "clean finish on-schedule",
        LoopOutcome.COMPLETED,
        10,
        10,
        10,
        True,
        True,
        None,
        R.ALREADY_SAVED,
    ),
    (
        "NaN on the last step",
        LoopOutcome.COMPLETED,
        10,
        10,
        8,
        False,
        True,
        None,
        R.NONFINITE_LAST_STEP,
    ),
    ("NaN abort on the last step", LoopOutcome.NAN_ABORT, 10, 10, 8, False, True, None, R.FAILURE),
    (
        "health failure on the last step",
        LoopOutcome.HEALTH_FAILURE,
        10,
        10,
        8,
        True,
        True,
        None,
        R.FAILURE,
    ),
    ("shutdown on the last step", LoopOutcome.SHUTDOWN, 10, 10, 10, True, True, None, R.SHUTDOWN),
    ("shutdown mid-run", LoopOutcome.SHUTDOWN, 5, 10, 5, True, True, None, R.SHUTDOWN),
    (
        "resumed already at max_steps",
        LoopOutcome.ALREADY_COMPLETE,
        10,
        10,
        10,
        True,
        True,
        None,
        R.NOTHING_TRAINED,
    ),
    (
        "resumed past max_steps",
        LoopOutcome.ALREADY_COMPLETE,
        12,
        10,
        12,
        True,
        True,
        None,
        R.NOTHING_TRAINED,
    ),
    ("data exhausted early", LoopOutcome.DATA_EXHAUSTED, 7, 10, 4, True, True, 7, R.DATA_EXHAUSTED),
    (
        "data exhausted on a saved step",
        LoopOutcome.DATA_EXHAUSTED,
        8,
        10,
        8,
        True,
        True,
        None,
        R.ALREADY_SAVED,
    ),
    (
        "data exhausted before any step",
        LoopOutcome.DATA_EXHAUSTED,
        0,
        10,
        None,
        True,
        True,
        None,
        R.NOTHING_TRAINED,
    ),
    ("checkpointing disabled", LoopOutcome.COMPLETED, 10, 10, None, True, False, None, R.DISABLED),
]


@pytest.mark.parametrize(
    "outcome,step,max_steps,last_saved,finite,enabled,save_step,reason",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_finalize_table(outcome, step, max_steps, last_saved, finite, enabled, save_step, reason):
    view = CheckpointView(step, max_steps, last_saved, finite, enabled)
    decision = finalize(outcome, view)
    assert decision.save is (save_step is not None)
    assert decision.step == save_step
    assert decision.reason is reason


def test_every_outcome_has_a_row():
    assert {c[1] for c in CASES} == set(LoopOutcome)


def test_finalize_module_imports_with_torch_unimportable():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from forge.training.finalize import finalize, CheckpointView\n"
        "from forge.training.loop import run_training_loop, conclude\n"
        "from forge.training.outcome import LoopOutcome\n"
        "print(finalize(LoopOutcome.COMPLETED, CheckpointView(3, 3, None)).save)\n"
        "import importlib.util; assert 'torch' not in [m for m in sys.modules if sys.modules[m]]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
