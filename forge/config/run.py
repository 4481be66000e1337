"""``[run]`` and ``[metrics]``: where a run lives and what it logs."""

from __future__ import annotations

import attrs

from forge.config.checks import Problem, not_empty, positive


@attrs.frozen
class RunConfig:
    """Where a run lives. ``dir`` defaults to ``runs/<config file stem>``."""

    dir: str | None = None

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        not_empty(p, "run.dir", self.dir)
        return p


@attrs.frozen
class MetricsConfig:
    """Step metrics to stdout and ``<run.dir>/metrics.jsonl`` every ``log_interval`` steps."""

    log_interval: int = 10
    jsonl: bool = True

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        positive(p, "metrics.log_interval", self.log_interval)
        return p
