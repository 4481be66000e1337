"""Where the scripts beside training run: the device and dtype choice, as tables."""

from __future__ import annotations

import argparse

import pytest
import torch

from forge.cli import DeviceRequest, DtypeRequest, request_parser
from forge.config import Precision
from forge.parallel.devices import DeviceChoice, choose_device, choose_dtype, stored_dtype

AUTO, CPU, CUDA = DeviceRequest.AUTO, DeviceRequest.CPU, DeviceRequest.CUDA


@pytest.mark.parametrize(
    ("request_", "cuda", "gpus", "local_rank", "device", "backend"),
    [
        (AUTO, False, 0, 0, "cpu", "gloo"),  # a CPU machine
        (AUTO, False, 0, 3, "cpu", "gloo"),  # several CPU ranks on one node
        (AUTO, True, 8, 0, "cuda:0", "nccl"),
        (AUTO, True, 8, 5, "cuda:5", "nccl"),  # each rank its own GPU
        (CUDA, True, 2, 1, "cuda:1", "nccl"),
        (CPU, True, 8, 3, "cpu", "gloo"),  # forced onto the CPU beside GPUs
    ],
)
def test_each_rank_runs_on_its_own_gpu_or_the_cpu(
    request_, cuda, gpus, local_rank, device, backend
):
    assert choose_device(request_, cuda, gpus, local_rank) == DeviceChoice(device, backend)


@pytest.mark.parametrize(
    ("request_", "cuda", "gpus", "local_rank", "problem"),
    [
        (CUDA, False, 0, 0, "--device cuda: torch sees no GPU here"),
        (AUTO, True, 2, 2, "local rank 2 has no GPU of its own (2 visible)"),
        (CUDA, True, 1, 4, "start at most 1 ranks per node, or pass --device cpu"),
    ],
)
def test_a_device_that_cannot_be_had_is_one_line(request_, cuda, gpus, local_rank, problem):
    choice = choose_device(request_, cuda, gpus, local_rank)
    assert choice.problem is not None and problem in choice.problem
    assert "\n" not in choice.problem


@pytest.mark.parametrize(
    ("request_", "stored", "dtype"),
    [
        (DtypeRequest.AUTO, torch.float32, torch.float32),  # the checkpoint's own
        (DtypeRequest.AUTO, torch.bfloat16, torch.bfloat16),
        (DtypeRequest.BFLOAT16, torch.float32, torch.bfloat16),
        (DtypeRequest.FLOAT32, torch.bfloat16, torch.float32),
    ],
)
def test_the_weights_keep_the_checkpoints_dtype_unless_asked(request_, stored, dtype):
    assert choose_dtype(request_, stored) == dtype


@pytest.mark.parametrize(
    ("param_dtype", "dtype"), [(Precision.FP32, torch.float32), (Precision.BF16, torch.bfloat16)]
)
def test_a_runs_checkpoints_hold_its_param_dtype(param_dtype, dtype):
    assert stored_dtype(param_dtype) == dtype


@pytest.mark.parametrize("request_", list(DeviceRequest) + list(DtypeRequest))
def test_the_requests_read_back_from_their_command_line_spelling(request_):
    assert type(request_)(str(request_)) is request_


@pytest.mark.parametrize(
    ("cls", "text", "member"),
    [
        (DtypeRequest, "bf16", DtypeRequest.BFLOAT16),  # the config's spelling
        (DtypeRequest, "FP32", DtypeRequest.FLOAT32),
        (DtypeRequest, "bfloat16", DtypeRequest.BFLOAT16),
        (DeviceRequest, "CUDA", DeviceRequest.CUDA),
    ],
)
def test_the_options_take_the_configs_spellings_in_any_case(cls, text, member):
    assert request_parser(cls)(text) is member


@pytest.mark.parametrize(
    ("cls", "text", "line"),
    [
        (DeviceRequest, "gpu", "'gpu': choose one of auto, cpu, cuda"),
        (DtypeRequest, "fp16", "'fp16': choose one of auto, float32, bfloat16"),
    ],
)
def test_an_unknown_option_value_names_the_choices(cls, text, line):
    with pytest.raises(argparse.ArgumentTypeError, match=line):
        request_parser(cls)(text)
