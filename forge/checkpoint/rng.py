"""The random streams a checkpoint carries per rank: the CPU's, Python's and this rank's GPU's.

Each rank saves the state of its own device only (``cuda:<local rank>``), not of every GPU it
can see, so a resume with fewer (or more) visible GPUs restores what each rank needs and at
most warns; which saved state goes where is decided by ``cuda_rng_to_restore`` (pure).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import torch

from forge.checkpoint.paths import CheckpointPath, save_tensors


@attrs.frozen
class CudaRngRestore:
    """The GPU state to set on this rank's current device (None: leave it) and why not, when
    the saved state does not fit the devices now visible."""

    state: torch.Tensor | None = None
    warning: str | None = None


def capture_rng() -> dict[str, Any]:
    """This process's RNG streams as tensors and plain values (loadable with weights_only)."""
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()  # the current device: this rank's
    return state


def cuda_rng_to_restore(saved: Any, visible: int, current: int) -> CudaRngRestore:
    """What of ``saved`` (a checkpoint's ``torch_cuda``: one device's state, a list of every
    visible device's as older checkpoints hold, or None) goes onto ``cuda:current`` with
    ``visible`` GPUs visible now."""
    if saved is None:
        if visible == 0:
            return CudaRngRestore()
        return CudaRngRestore(
            warning="the checkpoint holds no GPU random state (saved without a GPU); this "
            "rank's GPU stream starts from the seed"
        )
    if visible == 0:
        return CudaRngRestore(
            warning="the checkpoint's GPU random state is not restored: no GPU is visible"
        )
    if isinstance(saved, torch.Tensor):
        return CudaRngRestore(state=saved)
    states = list(saved)
    if current >= len(states):
        return CudaRngRestore(
            warning=f"the checkpoint holds GPU random states for {len(states)} devices, none "
            f"for cuda:{current}; its stream starts from the seed"
        )
    if len(states) != visible:
        return CudaRngRestore(
            state=states[current],
            warning=f"the checkpoint was saved with {len(states)} visible GPUs, now {visible}: "
            f"restored cuda:{current}'s stream only",
        )
    return CudaRngRestore(state=states[current])


def restore_rng(state: dict[str, Any], say: Callable[[str], None] | None = None) -> None:
    """Set this process's streams from ``capture_rng``'s ``state``; a GPU state that does not
    fit the devices visible now is skipped with one ``warning:`` line to ``say``."""
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    current = torch.cuda.current_device() if visible else 0
    plan = cuda_rng_to_restore(state.get("torch_cuda"), visible, current)
    if plan.state is not None:
        torch.cuda.set_rng_state(plan.state)
    if plan.warning is not None and say is not None:
        say(f"warning: {plan.warning}")


@attrs.frozen
class RngFile:
    """This rank's random streams, and where a save writes them."""

    path: CheckpointPath
    state: dict[str, Any]

    def write(self) -> None:
        save_tensors(self.state, self.path)
