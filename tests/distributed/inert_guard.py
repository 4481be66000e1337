"""``scripts/train.py`` with one guard's mechanism made inert (a mutant named by the first
argument), for the guard check that must then refuse to start:

- ``replicas``: no mesh dim counts as one whose ranks hold replicated values;
- ``health``: the control word gets no group of its own;
- ``stragglers``: the step is not timed (no own time reported);
- ``stacks``: the hang watchdog is never armed;
- ``kernels``: the kernel probe runs (as on CUDA), and rank 1's blocks run ``put_``, an
  operation torch names as having no deterministic kernel;
- ``signals_on_one``: rank 1 alone installs no shutdown handler (as a blocked signal mask
  inherited on one node would leave it);
- ``probe``: the kernel probe runs (as on CUDA), nothing else changed (not a mutant: the
  probed start must train as an unprobed one).
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys

import torch

from forge.model.transformer import TransformerBlock
from forge.resilience import control, stacks, stragglers
from forge.resilience.signals import ShutdownFlag
from forge.training.setup import guards
from forge.training.steps import replay

REPO = pathlib.Path(__file__).resolve().parents[2]


def no_group(self, world_size: int, timeout_s: float) -> None:
    self.group, self.failed = None, False


def put_on_rank_one() -> None:
    guards.checks_kernels = lambda device: True
    if os.environ["RANK"] != "1":
        return
    forward = TransformerBlock.forward

    def with_put(self, *args, **kwargs):
        torch.zeros(2).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
        return forward(self, *args, **kwargs)

    TransformerBlock.forward = with_put


def no_handler_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        ShutdownFlag.install = lambda self: self  # type: ignore[method-assign]


MUTANTS = {
    "replicas": lambda: setattr(replay, "REPLICATED_DIMS", ()),
    "health": lambda: setattr(control.ControlChannel, "__init__", no_group),
    "stragglers": lambda: setattr(stragglers, "timed", lambda step, *args: step),
    "stacks": lambda: setattr(stacks.StackWatch, "arm", lambda self: None),
    "kernels": put_on_rank_one,
    "signals_on_one": no_handler_on_rank_one,
    "probe": lambda: setattr(guards, "checks_kernels", lambda device: True),
}


def main() -> None:
    MUTANTS[sys.argv[1]]()
    sys.argv = [str(REPO / "scripts" / "train.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
