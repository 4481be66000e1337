"""Training on a GPU against what the CPU proves: a bf16 step against the fp32 CPU reference,
an async save and an exact resume on the device, and the memory plan against the allocator's
peak for a 1B model. Skipped without CUDA (run by benchmarks/gpu_check.sh)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from forge.config import ModelConfig, Precision, SchedulerConfig, load_config
from forge.data.batch import Batch
from forge.model.transformer import Transformer
from forge.optim import resolve_schedule
from forge.parallel.memory_plan import memory_plan
from forge.parallel.world import MeshDims
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step
from forge.types import LoopState
from tests.conftest import REPO
from tests.e2e.test_train_script import TRAIN, SignalAt, final_weights, losses, reference_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CFG = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, max_seq_len=128)
# bf16 compute against fp32: the loss agrees to bf16's ~3 significant digits; with SGD the
# weights move by lr × gradient, so they differ by lr × the gradients' bf16 error
LR, LOSS_RTOL, WEIGHT_ATOL = 0.1, 2e-2, 1e-3


def batches(n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, CFG.vocab_size, (4, 129), generator=g) for _ in range(n)]
    return [Batch(r[:, :-1], r[:, 1:]) for r in rows]


def trained(
    model: Transformer, precision: Precision, device: str
) -> tuple[list[float], Transformer]:
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # the update is the gradient itself
    sched = resolve_schedule(SchedulerConfig(warmup_steps=0), 100)
    step = make_text_step(StepSpec(model, opt, sched, LR, precision, 1.0))
    out, state = [], LoopState()
    for b in batches(3):
        result = step((b.to(torch.device(device)),), state)
        out.append(result.loss)
        state = LoopState(step=state.step + 1)
    return out, model


def test_a_bf16_step_on_the_gpu_matches_the_fp32_cpu_reference():
    torch.manual_seed(0)
    model = Transformer(CFG)
    cpu_losses, cpu_model = trained(copy.deepcopy(model), Precision.FP32, "cpu")
    gpu_losses, gpu_model = trained(model, Precision.BF16, "cuda")
    assert gpu_losses == pytest.approx(cpu_losses, rel=LOSS_RTOL)
    cpu_state, gpu_state = cpu_model.state_dict(), gpu_model.state_dict()
    for (name, a), b in zip(cpu_state.items(), gpu_state.values(), strict=True):
        torch.testing.assert_close(b.cpu(), a, atol=WEIGHT_ATOL, rtol=0, msg=name)


@pytest.fixture
def deterministic():
    """Deterministic kernels (cuBLAS needs CUBLAS_WORKSPACE_CONFIG, set by gpu_check.sh):
    the reference and the resumed run must compute each step the same way, which an
    atomics-based backward (SDPA's memory-efficient one) does not."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("mode", ["async", "async_process"])
def test_an_async_save_on_the_gpu_resumes_bit_identically(
    tiny_config, tmp_path, mode, deterministic
):
    async_save = f"--checkpoint.async_mode={mode}"
    reference = reference_config(tiny_config, tmp_path)
    assert TRAIN.main([str(reference), async_save]) == 0
    assert TRAIN.main([str(tiny_config), async_save], hooks=[SignalAt(5)]) == 75
    assert TRAIN.main([str(tiny_config), async_save]) == 0
    assert losses(tiny_config) == losses(reference)
    for name, tensor in final_weights(reference, 12).items():
        assert torch.equal(tensor, final_weights(tiny_config, 12)[name]), name


def test_the_memory_plan_is_within_a_quarter_of_the_allocators_peak_for_1b(tmp_path, small_corpus):
    args = [
        str(REPO / "configs" / "train" / "llama3_1b.toml"),
        f"--run.dir={tmp_path / 'run'}",
        f"--data.path={small_corpus}",
        "--train.max_steps=3",
        "--train.batch_size=2",
        "--train.seq_len=2048",
        "--train.grad_accum_steps=1",
        "--metrics.log_interval=1",
        "--eval.interval=0",
        "--checkpoint.enabled=false",
    ]
    assert TRAIN.main(args) == 0
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    peak_gb = max(r.get("memory/peak_allocated_gb", 0.0) for r in records)
    config = load_config(args[:1] + args[2:]).config
    planned_gb = memory_plan(config, MeshDims()).total / 2**30
    assert 0.75 * peak_gb <= planned_gb <= 1.25 * peak_gb, (planned_gb, peak_gb)
