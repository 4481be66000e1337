"""Optional metric sinks: TensorBoard and Weights & Biases (rank 0 only, extras installed).

Each one continues the same run when training resumes: TensorBoard drops the events a crashed
run wrote past the step the resumed one starts logging at; W&B resumes the run whose id the
first launch stored in ``<run.dir>/wandb_run_id``.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import Any

from forge.config.sections import JobConfig

# (config key, module to import, extra to install)
OPTIONAL_SINKS = (
    ("metrics.tensorboard", "tensorboard", "tensorboard"),
    ("metrics.wandb", "wandb", "wandb"),
)


def missing_sink_packages(config: JobConfig) -> list[str]:
    """One ``key: message`` line per enabled sink whose package is not installed."""
    enabled = {
        "metrics.tensorboard": config.metrics.tensorboard,
        "metrics.wandb": config.metrics.wandb,
    }
    return [
        f"{key}: needs the '{module}' package; install it with pip install 'forge[{extra}]' "
        "(or set the key to false)"
        for key, module, extra in OPTIONAL_SINKS
        if enabled[key] and importlib.util.find_spec(module) is None
    ]


WANDB_HOST = "api.wandb.ai"


def wandb_credentials_problem(env: Mapping[str, str], netrc: pathlib.Path) -> str | None:
    """Why ``metrics.wandb`` cannot log online (checked before the run directory exists), or
    None: offline or disabled mode, an API key in the environment, or a ``wandb login`` entry
    in ``netrc`` for the server (``WANDB_BASE_URL``'s host, by default W&B's own)."""
    if env.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return None
    if env.get("WANDB_API_KEY"):
        return None
    host = urllib.parse.urlparse(env.get("WANDB_BASE_URL", "")).hostname or WANDB_HOST
    try:
        if host in netrc.read_text():
            return None
    except OSError:
        pass
    return (
        "metrics.wandb: no W&B credentials (no WANDB_API_KEY, no wandb login entry in "
        f"{netrc}); run wandb login, set WANDB_API_KEY, or WANDB_MODE=offline to log locally"
    )


def sink_problems(config: JobConfig, env: Mapping[str, str]) -> list[str]:
    """What the enabled sinks lack: their packages (``missing_sink_packages``) and, for W&B,
    credentials (``wandb_credentials_problem``; ``$NETRC``, else ``~/.netrc``)."""
    problems = missing_sink_packages(config)
    if config.metrics.wandb and not problems:
        netrc = pathlib.Path(env["NETRC"]) if env.get("NETRC") else netrc_path(env)
        problem = wandb_credentials_problem(env, netrc)
        problems += [problem] if problem else []
    return problems


def netrc_path(env: Mapping[str, str]) -> pathlib.Path:
    """``~/.netrc`` (``$HOME``'s; the current folder's when there is no home)."""
    home = env.get("HOME")
    return pathlib.Path(home if home else ".") / ".netrc"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numeric values other than ``step`` (what a scalar logger takes)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoardSink:
    """Event files under ``log_dir``; the writer opens at the first record, purging events at
    or after its step that an earlier, crashed run left."""

    def __init__(self, log_dir: pathlib.Path) -> None:
        self.log_dir = log_dir
        self.writer: Any = None

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir), purge_step=step)
        for key, value in scalars(record).items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def wandb_run_id(run_dir: pathlib.Path, new_id: str, id_file: str = "wandb_run_id") -> str:
    """The run's W&B id: the stored one (in ``id_file``), else ``new_id``, stored for the next
    launch."""
    path = run_dir / id_file
    if path.is_file():
        stored = path.read_text().strip()
        if stored:
            return stored
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(new_id + "\n")
    return new_id


class WandbSink:
    """A W&B run named after the run directory (or ``metrics.wandb_name``), resumed by the id
    stored in the run directory; ``WANDB_MODE`` (e.g. ``offline``) is honoured by wandb.
    ``role`` names a second writer of the same run's records (the evaluation follower): a W&B
    run of its own, ``<name>-<role>`` in the trainer's group and project (a W&B run takes one
    writer), its id stored beside the trainer's."""

    config_key = "metrics.wandb"

    def __init__(self, config: JobConfig, run_dir: pathlib.Path, role: str | None = None) -> None:
        import wandb

        m = config.metrics
        self.wandb = wandb
        name = m.wandb_name or run_dir.name
        self.run = wandb.init(
            project=m.wandb_project,
            name=f"{name}-{role}" if role else name,
            group=m.wandb_group,
            job_type=role,
            tags=list(m.wandb_tags),
            id=wandb_run_id(
                run_dir, uuid.uuid4().hex[:8], f"wandb_{role}_run_id" if role else "wandb_run_id"
            ),
            resume="allow",
            dir=str(run_dir),
            config={"run_dir": str(run_dir)},
        )

    def write(self, record: Mapping[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()
