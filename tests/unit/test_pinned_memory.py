"""Page-locked host memory where a GPU copy goes through it: the decisions as tables, and
the CPU buffers they give (the GPU side runs in tests/cuda/test_device_paths.py)."""

from __future__ import annotations

import pytest
import torch

from forge.checkpoint.async_staging import ReusingStager, host_buffer, pinned_staging
from forge.data.batch import Batch
from forge.data.loader import pins_host_memory


@pytest.mark.parametrize(
    ("source", "cuda", "pinned"),
    [("cuda", True, True), ("cpu", True, False), ("cpu", False, False), ("meta", False, False)],
)
def test_staging_is_pinned_for_gpu_tensors_only(source, cuda, pinned):
    assert pinned_staging(source, cuda) is pinned


@pytest.mark.parametrize(("device", "pins"), [("cuda:0", True), ("cuda", True), ("cpu", False)])
def test_batches_go_through_pinned_memory_to_a_gpu_only(device, pins):
    assert pins_host_memory(torch.device(device)) is pins


@pytest.mark.parametrize("shared", [False, True])
def test_an_unpinned_host_buffer_is_shared_when_asked(shared):
    buffer = host_buffer(torch.Size([3, 2]), torch.bfloat16, shared=shared, pinned=False)
    assert buffer.shape == (3, 2) and buffer.dtype == torch.bfloat16
    assert buffer.is_shared() is shared and not buffer.is_pinned()


def test_cpu_staging_copies_reuse_their_buffers_and_wait_for_nothing():
    stager = ReusingStager(shared=False)
    state = {"w": torch.arange(6.0).view(2, 3)}
    first = stager.stage(state)["w"]
    state["w"].add_(1)  # the next step changes the weights: the staged copy must not
    assert torch.equal(first, torch.arange(6.0).view(2, 3))
    second = stager.stage(state)["w"]
    assert second.data_ptr() == first.data_ptr() and not stager._pending_copies


def test_a_batch_for_the_cpu_is_not_copied():
    batch = Batch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    assert batch.to(torch.device("cpu")) is batch
