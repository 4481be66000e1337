"""should_save, milestones and the retention plan."""

import pytest

from forge.checkpoint.policy import SaveSchedule, retention_plan, step_of

PLAIN = SaveSchedule(interval=10)
WINDOW = SaveSchedule(interval=10, window_start=0, window_stop=16)
LATE = SaveSchedule(interval=10, window_start=100, window_stop=110)


@pytest.mark.parametrize(
    "schedule,saved_steps",
    [
        (PLAIN, [10, 20, 30]),
        (WINDOW, [0, 1, 2, 4, 8, 16, 20, 30]),  # 10 is inside the window and not a milestone
        (LATE, [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 101, 102, 104, 108, 120]),
    ],
    ids=["interval only", "window from 0", "window later"],
)
def test_should_save_over_a_range(schedule, saved_steps):
    top = 120 if schedule is LATE else 30
    assert [s for s in range(top + 1) if schedule.should_save(s)] == saved_steps


@pytest.mark.parametrize(
    "step,expected", [(0, True), (1, True), (3, False), (8, True), (16, True), (17, False)]
)
def test_is_milestone(step, expected):
    assert WINDOW.is_milestone(step) is expected


@pytest.mark.parametrize(
    "name,expected",
    [("step_0", 0), ("step_120", 120), ("step_12.tmp", None), ("latest", None), ("step_x", None)],
)
def test_step_of(name, expected):
    assert step_of(name) == expected


# (case, complete steps, keep, latest, schedule, in_flight, incomplete steps, deleted)
RETENTION = [
    ("keeps the newest n", [10, 20, 30, 40], 2, 40, PLAIN, None, [], [10, 20]),
    ("keep <= 0 keeps all", [10, 20, 30], 0, 30, PLAIN, None, [], []),
    ("fewer than n", [10], 3, 10, PLAIN, None, [], []),
    ("never deletes latest", [10, 20, 30], 1, 10, PLAIN, None, [], [20]),
    ("never deletes a milestone", [1, 2, 4, 20, 30], 1, 30, WINDOW, None, [], [20]),
    ("never deletes the in-flight save", [10, 20, 30], 1, 20, PLAIN, 10, [], []),
    ("a newer incomplete one does not count", [4, 8], 2, 8, PLAIN, None, [20], []),
    ("a newer incomplete one is kept for the report", [4, 8, 12], 2, 12, PLAIN, None, [20], [4]),
    ("an older incomplete one goes", [4, 8], 2, 8, PLAIN, None, [6], [6]),
    ("incomplete ones stay while none is complete", [], 2, None, PLAIN, None, [6], []),
]


@pytest.mark.parametrize(
    "steps,keep,latest,schedule,in_flight,incomplete,deleted",
    [r[1:] for r in RETENTION],
    ids=[r[0] for r in RETENTION],
)
def test_retention_plan(steps, keep, latest, schedule, in_flight, incomplete, deleted):
    assert retention_plan(steps, keep, latest, schedule, in_flight, incomplete) == deleted
