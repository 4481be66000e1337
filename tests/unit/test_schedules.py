"""LR schedules as pure functions of the step."""

import itertools

import pytest

from forge.config.sections import ScheduleName, SchedulerConfig
from forge.optim.schedules import lr_at, lr_multiplier, resolve_schedule

ALL = list(ScheduleName)


def sched(name, warmup=10, decay=None, floor=0.1, max_steps=100):
    return resolve_schedule(SchedulerConfig(name, warmup, decay, floor), max_steps)


@pytest.mark.parametrize("name", ALL)
def test_first_step_never_runs_at_lr_zero(name):
    assert lr_multiplier(sched(name), 0) > 0
    assert lr_multiplier(sched(name, warmup=0), 0) > 0


@pytest.mark.parametrize("name", [n for n in ALL if n is not ScheduleName.NONE])
def test_warmup_is_linear_up_to_the_peak(name):
    s = sched(name, warmup=4)
    assert [lr_multiplier(s, k) for k in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


# (name, step, expected multiplier) with warmup 10, max_steps 100, floor 0.1
POINTS = [
    (ScheduleName.COSINE, 10, 1.0),
    (ScheduleName.COSINE, 55, 0.55),
    (ScheduleName.COSINE, 100, 0.1),
    (ScheduleName.LINEAR, 55, 0.55),
    (ScheduleName.LINEAR, 100, 0.1),
    (ScheduleName.REX, 10, 1.0),
    (ScheduleName.REX, 55, 0.1 + 0.9 * (0.5 / 0.75)),  # halfway: (1 - 1/2) / (1 - 1/4)
    (ScheduleName.REX, 100, 0.1),
    (ScheduleName.CONSTANT, 99, 1.0),
    (ScheduleName.NONE, 0, 1.0),  # no warmup: warmup_steps is ignored
    (ScheduleName.NONE, 5, 1.0),
    (ScheduleName.NONE, 99, 1.0),
    (ScheduleName.WSD, 79, 1.0),  # stable until the last 20% (decay_steps default)
    (ScheduleName.WSD, 80, 1.0),
    (ScheduleName.WSD, 90, 0.55),
    (ScheduleName.WSD, 100, 0.1),
]


@pytest.mark.parametrize("name,step,expected", POINTS)
def test_schedule_values(name, step, expected):
    assert lr_multiplier(sched(name), step) == pytest.approx(expected)


def test_every_schedule_has_rows_in_the_table():
    assert {name for name, _, _ in POINTS} == set(ScheduleName)


@pytest.mark.parametrize(
    "name", [ScheduleName.COSINE, ScheduleName.LINEAR, ScheduleName.REX, ScheduleName.WSD]
)
def test_decay_is_monotone_after_warmup(name):
    s = sched(name)
    values = [lr_multiplier(s, k) for k in range(10, 120)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert min(values) == pytest.approx(0.1)


def test_explicit_decay_steps_are_independent_of_max_steps():
    a = resolve_schedule(SchedulerConfig(ScheduleName.COSINE, 10, 90, 0.1), 50)
    b = resolve_schedule(SchedulerConfig(ScheduleName.COSINE, 10, 90, 0.1), 100)
    assert [lr_multiplier(a, k) for k in range(50)] == [lr_multiplier(b, k) for k in range(50)]


def test_lr_at_scales_the_peak():
    assert lr_at(sched(ScheduleName.CONSTANT), 3e-4, 50) == pytest.approx(3e-4)
