"""The planner's pipeline bubble: the idle share of a rank's step, per schedule."""

import pytest

from forge.config.distributed import PipelineSchedule as S
from forge.parallel.bubble import bubble_fraction

# (schedule, pp, stages per rank, micro-batches, bubble): F = B = W = 1, work 3m per rank
CASES = [
    (S.ONE_F_ONE_B, 1, 1, 4, 0.0),  # no pipeline, no bubble
    (S.GPIPE, 2, 1, 4, 3 / 15),
    (S.ONE_F_ONE_B, 2, 1, 4, 3 / 15),  # same bubble as GPipe, less memory
    (S.ONE_F_ONE_B, 4, 1, 8, 9 / 33),
    (S.ONE_F_ONE_B, 4, 1, 32, 9 / 105),  # more micro-batches shrink it
    (S.INTERLEAVED_1F1B, 2, 2, 4, 1.5 / 13.5),  # v stages per rank divide it by v
    (S.INTERLEAVED_1F1B, 4, 4, 8, 2.25 / 26.25),
    (S.INTERLEAVED_ZERO_BUBBLE, 2, 2, 4, 0.5 / 12.5),  # a third of interleaved 1F1B's
    (S.ZBV, 2, 2, 4, 0.0),
    (S.ZBV, 8, 2, 16, 0.0),
    (S.DUALPIPEV, 2, 2, 8, 0.0),  # (p / 2 - 1) idle: none at two ranks
    (S.DUALPIPEV, 4, 2, 8, 2 / 26),
]


@pytest.mark.parametrize("schedule,pp,v,m,expected", CASES)
def test_bubble_fraction(schedule, pp, v, m, expected):
    assert bubble_fraction(schedule, pp, v, m) == pytest.approx(expected)


def test_the_schedules_rank_as_their_papers_say():
    order = [S.ONE_F_ONE_B, S.INTERLEAVED_1F1B, S.INTERLEAVED_ZERO_BUBBLE, S.ZBV]
    values = [bubble_fraction(s, 4, 1 if s is S.ONE_F_ONE_B else 2, 8) for s in order]
    assert values == sorted(values, reverse=True)
    assert values[0] > values[1] > values[2] > values[3] == 0.0
