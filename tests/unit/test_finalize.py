"""The final-save decision, one row per case, with no torch anywhere."""

import subprocess
import sys

import pytest

from forge.training.loop.finalize import CheckpointView, FinalSaveReason, finalize
from forge.types import LoopOutcome

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
        "NaN on the last step, update skipped: save its state",
        LoopOutcome.COMPLETED,
        10,
        10,
        8,
        False,
        True,
        10,
        R.SKIPPED_LAST_STEP,
    ),
    (
        "NaN on the last step of a run never saved",
        LoopOutcome.COMPLETED,
        5,
        5,
        None,
        False,
        True,
        5,
        R.SKIPPED_LAST_STEP,
    ),
    (
        "NaN on the last step, the step before is saved",
        LoopOutcome.COMPLETED,
        10,
        10,
        9,
        False,
        True,
        None,
        R.NONFINITE_STATE_SAVED,
    ),
    (
        "NaN on the last step, data exhausted",
        LoopOutcome.DATA_EXHAUSTED,
        7,
        10,
        4,
        False,
        True,
        7,
        R.SKIPPED_LAST_STEP,
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
    (
        "replay mismatch mid-run",
        LoopOutcome.REPLAY_MISMATCH,
        3,
        10,
        2,
        False,
        True,
        None,
        R.FAILURE,
    ),
    (
        "fp8 drift stop mid-run",
        LoopOutcome.FLOAT8_DRIFT,
        4,
        10,
        2,
        False,
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


# (case, step, last_saved, streak, skips_keep_weights, save_step, reason)
NONFINITE_TAIL = [
    ("two skipped, the last finite step saved", 10, 8, 2, True, None, R.NONFINITE_STATE_SAVED),
    ("three skipped, the last finite step not saved", 10, 6, 3, True, 10, R.SKIPPED_LAST_STEP),
    ("weights may be corrupt: the seed's rule", 10, 8, 1, False, None, R.NONFINITE_LAST_STEP),
    ("weights may be corrupt, never saved", 5, None, 1, False, None, R.NONFINITE_LAST_STEP),
]


@pytest.mark.parametrize(
    "step,last_saved,streak,keeps,save_step,reason",
    [c[1:] for c in NONFINITE_TAIL],
    ids=[c[0] for c in NONFINITE_TAIL],
)
def test_a_skipped_last_step_saves_only_what_no_checkpoint_holds(
    step, last_saved, streak, keeps, save_step, reason
):
    view = CheckpointView(
        step,
        step,
        last_saved,
        last_step_finite=False,
        skips_keep_weights=keeps,
        nonfinite_streak=streak,
    )
    decision = finalize(LoopOutcome.COMPLETED, view)
    assert (decision.step, decision.reason) == (save_step, reason)


def test_every_outcome_has_a_row():
    assert {c[1] for c in CASES} == set(LoopOutcome)


def test_finalize_module_imports_with_torch_unimportable():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from forge.training.loop.finalize import finalize, CheckpointView\n"
        "from forge.training.loop.loop import run_training_loop, conclude\n"
        "from forge.training.loop.plan import plan_step\n"
        "from forge.types import LoopOutcome\n"
        "print(finalize(LoopOutcome.COMPLETED, CheckpointView(3, 3, None)).save)\n"
        "import importlib.util; assert 'torch' not in [m for m in sys.modules if sys.modules[m]]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
