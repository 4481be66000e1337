"""``[run]`` and ``[metrics]``: where a run lives and what it logs."""

from __future__ import annotations

import attrs

from forge.config.ranges import Problem, non_negative, not_empty, positive, usable_path


@attrs.frozen
class RunConfig:
    """Where a run lives. ``dir`` defaults to ``runs/<config file stem>``."""

    dir: str | None = None

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        not_empty(p, "run.dir", self.dir)
        usable_path(p, "run.dir", self.dir)
        return p


@attrs.frozen
class MetricsConfig:
    """Step metrics to stdout and ``<run.dir>/metrics.jsonl`` every ``log_interval`` steps;
    optionally to TensorBoard (``<run.dir>/tensorboard``) and Weights & Biases, from rank 0."""

    log_interval: int = 10
    jsonl: bool = True
    tensorboard: bool = False  # needs the optional extra: pip install 'forge[tensorboard]'
    wandb: bool = False  # needs 'forge[wandb]'; WANDB_MODE=offline writes the run locally
    wandb_project: str = "forge"
    wandb_name: str | None = None  # None: the run directory's name
    wandb_group: str | None = None
    wandb_tags: list[str] = attrs.Factory(list)

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        positive(p, "metrics.log_interval", self.log_interval)
        not_empty(p, "metrics.wandb_project", self.wandb_project)
        return p


@attrs.frozen
class ProfilerConfig:
    """``torch.profiler`` over a window of steps: skip ``wait``, warm up ``warmup``, record
    ``active``; ``repeat`` such cycles (0: until the run ends). Chrome traces go to
    ``<run.dir>/profiler/``."""

    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        non_negative(p, "profiler.wait", self.wait)
        non_negative(p, "profiler.warmup", self.warmup)
        positive(p, "profiler.active", self.active)
        non_negative(p, "profiler.repeat", self.repeat)
        return p
