"""A checkpoint's GPU random state restored onto the GPUs visible now: fewer, more or none is
at most one warning, never a crash (the devices simulated: the decision is pure)."""

from __future__ import annotations

import random

import pytest
import torch

from forge.checkpoint.rng import capture_rng, cuda_rng_to_restore, restore_rng

A, B, C = (torch.full((4,), i, dtype=torch.uint8) for i in range(3))


@pytest.mark.parametrize(
    ("saved", "visible", "current", "state", "warning"),
    [
        (None, 0, 0, None, None),  # CPU to CPU
        (A, 1, 0, A, None),  # this rank's device state, onto this rank's device
        (A, 8, 5, A, None),
        ([A, B], 2, 1, B, None),  # an older checkpoint: every visible device's state
        ([A, B, C], 2, 1, B, "saved with 3 visible GPUs, now 2: restored cuda:1's stream only"),
        ([A], 4, 0, A, "saved with 1 visible GPUs, now 4"),
        ([A], 4, 2, None, "none for cuda:2; its stream starts from the seed"),
        (A, 0, 0, None, "not restored: no GPU is visible"),
        ([A, B], 0, 0, None, "not restored: no GPU is visible"),
        (None, 2, 1, None, "holds no GPU random state (saved without a GPU)"),
    ],
    ids=[
        "cpu-cpu", "one-one", "rank-5", "old-same-count", "old-fewer", "old-more",
        "old-missing", "gpu-to-cpu", "old-gpu-to-cpu", "cpu-to-gpu",
    ],
)  # fmt: skip
def test_the_saved_gpu_state_fits_whatever_is_visible(saved, visible, current, state, warning):
    plan = cuda_rng_to_restore(saved, visible, current)
    assert (plan.state is None) == (state is None)
    if state is not None:
        assert torch.equal(plan.state, state)
    if warning is None:
        assert plan.warning is None
    else:
        assert plan.warning is not None and warning in plan.warning


def test_a_gpu_state_restored_on_a_cpu_machine_warns_once_and_restores_the_rest():
    torch.manual_seed(11)
    random.seed(11)
    saved = capture_rng() | {"torch_cuda": [A, B]}  # as a 2-GPU run saved it
    expected = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    said: list[str] = []
    restore_rng(saved, said.append)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert len(said) == (0 if torch.cuda.is_available() else 1)
    if said:
        assert said[0].startswith("warning: ") and "no GPU is visible" in said[0]
