"""The pure rules of forge's precision features that need no torchao: where FSDP2 gathers the
FP8 layers' weights in FP8 (``forge.parallel.float8.gathers_in_float8``), and what the
deterministic mode says and sets (``forge.training.steps.replay``)."""

from __future__ import annotations

import attrs
import pytest
import torch

from forge.config.fault_tolerance import FaultToleranceConfig
from forge.config.sections import Float8Recipe, JobConfig
from forge.parallel.float8 import gathers_in_float8
from forge.training.steps.replay import (
    cuda_determinism_env,
    deterministic_line,
    kernel_modes_kept,
    use_deterministic_kernels,
)

TENSORWISE = JobConfig(train=attrs.evolve(JobConfig().train, float8=Float8Recipe.TENSORWISE))


def changed(config: JobConfig, section: str, **values: object) -> JobConfig:
    return attrs.evolve(config, **{section: attrs.evolve(getattr(config, section), **values)})


@pytest.mark.parametrize(
    "config,fsdp,gathers",
    [
        (TENSORWISE, True, True),  # FSDP2 gathers FP8 bytes
        (TENSORWISE, False, False),  # nothing gathered
        (changed(TENSORWISE, "train", float8=Float8Recipe.ROWWISE), True, False),  # a row's scale
        (changed(TENSORWISE, "train", float8=Float8Recipe.OFF), True, False),
        (changed(TENSORWISE, "distributed", tp=2), True, False),  # TP's plan would split it
        (changed(TENSORWISE, "distributed", pp=2), True, False),  # not tried yet
        (changed(TENSORWISE, "train", float8_check=10), True, False),  # the guard: high precision
        (attrs.evolve(TENSORWISE, fault_tolerance=FaultToleranceConfig(enabled=True)), True, False),
    ],
    ids=["tensorwise", "no fsdp", "rowwise", "off", "tp", "pp", "drift guard", "replica groups"],
)
def test_fsdp2_gathers_fp8_weights_in_fp8_where_the_recipe_and_layout_allow(config, fsdp, gathers):
    assert gathers_in_float8(config, fsdp) is gathers


@pytest.mark.parametrize(
    "device,words",
    [
        ("cuda", "; cuDNN picks no kernel by timing; cuBLAS's workspace fixed"),
        ("cpu", " (a CPU's kernels already are: no bit changes)"),
    ],
)
def test_the_deterministic_modes_start_line_says_what_it_does_on_the_device(device, words):
    said = "deterministic: every operation runs a deterministic kernel, or torch names it"
    assert deterministic_line(device) == f"{said}{words}"


@pytest.mark.parametrize(
    "env,after",
    [
        ({}, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
        ({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}),  # the user's
    ],
)
def test_the_deterministic_mode_gives_cublas_a_workspace_unless_one_is_set(env, after):
    cuda_determinism_env(env)
    assert env == after


# (case, whether the run set the modes, the calls that set them on the way out)
KEPT = [
    # a signal that ends set-up inside an import of torch._inductor leaves it half-initialised:
    # a call then fails (it imports torch._inductor.config), so none is made
    ("set-up ended before the modes changed: none", False, []),
    ("the run made kernels deterministic: set back", True, [(False, False)]),
]


@pytest.mark.parametrize("changed,calls", [k[1:] for k in KEPT], ids=[k[0] for k in KEPT])
def test_the_kernel_modes_are_set_back_only_when_the_run_changed_them(monkeypatch, changed, calls):
    real, made = torch.use_deterministic_algorithms, []

    def recorded(mode: bool, warn_only: bool = False) -> None:
        made.append((mode, warn_only))
        real(mode, warn_only=warn_only)

    with kernel_modes_kept():
        if changed:
            use_deterministic_kernels()
        monkeypatch.setattr(torch, "use_deterministic_algorithms", recorded)
    assert made == calls
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic
