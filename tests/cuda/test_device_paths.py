"""The GPU paths the CPU cannot run: pinned staging and batches, the RNG of this rank's GPU,
and an async save and exact resume on the device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from forge.checkpoint.async_staging import ReusingStager
from forge.checkpoint.rng import capture_rng, restore_rng
from forge.data.batch import Batch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("shared", [False, True])
def test_gpu_tensors_are_staged_in_pinned_memory_and_equal(shared):
    stager = ReusingStager(shared=shared)
    source = torch.randn(1024, 1024, device="cuda")
    staged = stager.stage({"w": source})["w"]
    assert staged.device.type == "cpu" and torch.equal(staged, source.cpu())
    assert staged.is_pinned()  # shared memory too: registered with CUDA
    assert staged.is_shared() is shared
    source.add_(1)  # the next step: the copy is complete and isolated
    assert not torch.equal(staged, source.cpu())


def test_the_loader_pins_its_batches_for_the_gpu_with_and_without_workers(small_corpus):
    from forge.data.dataset import open_windows
    from forge.data.loader import TextLoader, single_source
    from forge.data.shards import read_manifest

    manifest = read_manifest(small_corpus)
    windows = open_windows(small_corpus, manifest, "train", 16, False)
    for workers in (0, 1):
        sampling = single_source(len(windows), batch_size=2, seed=0)
        loader = TextLoader([windows], sampling, num_workers=workers, device="cuda")
        batch = next(loader)
        loader.close()
        assert batch.inputs.is_cuda and batch.labels.is_cuda, workers


def test_a_pinned_batch_reaches_the_gpu_whole():
    batch = Batch(torch.arange(12).view(3, 4), torch.arange(12).view(3, 4) + 1).pin_memory()
    assert batch.inputs.is_pinned()
    moved = batch.to(torch.device("cuda"))
    torch.cuda.synchronize()
    assert moved.inputs.is_cuda and torch.equal(moved.labels.cpu(), batch.labels)


def test_the_rng_of_this_ranks_gpu_is_saved_and_restored():
    torch.cuda.manual_seed(3)
    saved = capture_rng()
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(4)
    said: list[str] = []
    restore_rng(saved, said.append)
    assert torch.equal(torch.rand(4, device="cuda"), expected) and said == []
