"""The pipeline bubble of each schedule: the share of a rank's step spent idle.

The model is the one the schedules' papers use: per micro-batch and stage, a forward ``F``, a
backward for the inputs ``B`` and one for the weights ``W``, each one unit (the whole work
of a rank is ``3 m`` units for ``m`` micro-batches, whatever its number of virtual stages
``v``). The DeepSeek-V3 report's ``B`` is the whole backward, ``B'`` here; ``F&B`` a
forward and a whole backward, not overlapped. The idle time per rank is then

| schedule | idle units | source |
|---|---|---|
| gpipe, 1f1b | ``(p - 1)(F + B + W)`` | GPipe; Narayanan et al. 2021 (PipeDream-Flush) |
| interleaved_1f1b | ``(p - 1)(F + B + W) / v`` | Narayanan et al. 2021 (Megatron-LM) |
| interleaved_zero_bubble | ``(p - 1)(F + B - W) / v`` | Qi et al. 2023 (ZB-H1), looped |
| zbv | ``(p - 1)(F + B - 2W)`` | Qi et al. 2023 (ZB-V) |
| dualpipev | ``(p / 2 - 1)(F&B + B' - 3W)``, ``B' = B + W``, ``F&B = F + B'`` | DeepSeek-V3 |

Communication, unequal stages and a slower ``B`` than ``F`` move every figure up; the table
ranks the schedules, it does not predict a step time.
"""

from __future__ import annotations

from forge.config.distributed import PipelineSchedule

F = B = W = 1.0  # the model's unit costs


def idle_units(schedule: PipelineSchedule, pp: int, stages_per_rank: int) -> float:
    """A rank's idle time per step, in units of one stage's forward (see the table above)."""
    p, v = pp, stages_per_rank
    if schedule in (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B):
        return (p - 1) * (F + B + W)
    if schedule is PipelineSchedule.INTERLEAVED_1F1B:
        return (p - 1) * (F + B + W) / v
    if schedule is PipelineSchedule.INTERLEAVED_ZERO_BUBBLE:
        return (p - 1) * (F + B - W) / v
    if schedule is PipelineSchedule.ZBV:
        return max(0.0, (p - 1) * (F + B - 2 * W))
    whole_backward = B + W
    return max(0.0, (p / 2 - 1) * ((F + whole_backward) + whole_backward - 3 * W))  # DUALPIPEV


def bubble_fraction(
    schedule: PipelineSchedule, pp: int, stages_per_rank: int, micro_batches: int
) -> float:
    """The idle share of a rank's step: idle / (work + idle); 0 without a pipeline."""
    if pp <= 1:
        return 0.0
    idle = idle_units(schedule, pp, stages_per_rank)
    work = micro_batches * (F + B + W)
    return idle / (work + idle)
