"""``[profiler]``: ``torch.profiler`` over a window of training steps, as a hook."""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from forge.config.sections import ProfilerConfig
from forge.types import Hooks, LoopOutcome, LoopState, StepResult

TOP_OPS = 15


class ProfilerHooks(Hooks):
    """Starts the profiler with the run, advances its schedule every step, writes each
    recorded window as a Chrome trace ``<dir>/rank<r>_step<n>.json``, and prints the top
    ops by self time once (on rank 0, after the first window)."""

    def __init__(self, cfg: ProfilerConfig, trace_dir: pathlib.Path, rank: int) -> None:
        self.trace_dir = trace_dir
        self.rank = rank
        self.printed = False
        self.step = 0
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat
            ),
            on_trace_ready=self._trace_ready,
            record_shapes=True,
            profile_memory=True,
        )

    def _trace_ready(self, prof: Any) -> None:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_dir / f"rank{self.rank}_step{self.step}.json"))
        if self.rank == 0 and not self.printed:
            device = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            print(f"[forge] profiler: top {TOP_OPS} ops by self time, steps up to {self.step}")
            print(prof.key_averages().table(sort_by=device, row_limit=TOP_OPS), flush=True)
            self.printed = True

    def on_train_begin(self, state: LoopState) -> None:
        self.step = state.step
        self.profiler.start()

    def on_step_end(self, state: LoopState, result: StepResult) -> None:
        self.step = state.step
        self.profiler.step()

    def on_train_end(self, outcome: LoopOutcome, state: LoopState) -> None:
        self.profiler.stop()


def profiler_hooks(cfg: ProfilerConfig, run_dir: pathlib.Path, rank: int) -> list[Hooks]:
    """The profiler hook when ``[profiler] enabled``, else none."""
    if not cfg.enabled:
        return []
    return [ProfilerHooks(cfg, run_dir / "profiler", rank)]
