"""The whole run configuration, one attribute per TOML table. Each section lives in a module
named for its concern (``model``, ``vision``, ``train``, ``optim``, ``data``, ``checkpoint``,
``rope``, ``run``, ``resilience``, ``distributed``, ``freeze``); this module composes them and
re-exports every name, so ``from forge.config.sections import ...`` keeps working.

Each section's ``problems()`` returns every out-of-range value as ``(key, message)`` pairs, so
that the loader can report all of them at once instead of stopping at the first.
"""

from __future__ import annotations

import attrs

from forge.config.checkpoint import (
    AsyncMode,
    CheckpointConfig,
    DynamicWindow,
    ExportDtype,
    ScheduleSource,
    Verification,
)
from forge.config.data import DataConfig, DataPhase, DataSource, EvalConfig, EvalTask
from forge.config.distributed import DistributedConfig, PipelineSchedule
from forge.config.fault_tolerance import FaultToleranceConfig
from forge.config.freeze import FreezeRule
from forge.config.hooks import HooksConfig
from forge.config.model import ModelConfig, MoeRouter
from forge.config.optim import OptimizerConfig, OptimizerName, ScheduleName, SchedulerConfig
from forge.config.ranges import Problem
from forge.config.resilience import NonFinitePolicy, ResilienceConfig, SpikePolicy
from forge.config.rope import RopeScaling, RopeScalingType
from forge.config.run import MetricsConfig, ProfilerConfig, RunConfig
from forge.config.train import ActivationCheckpointing, Float8Recipe, Precision, TrainConfig
from forge.config.vision import VisionConfig, VisionEncoderKind, VlmArch

__all__ = [
    "ActivationCheckpointing",
    "AsyncMode",
    "CheckpointConfig",
    "DataConfig",
    "DataPhase",
    "DataSource",
    "DistributedConfig",
    "DynamicWindow",
    "EvalConfig",
    "EvalTask",
    "ExportDtype",
    "FaultToleranceConfig",
    "Float8Recipe",
    "FreezeRule",
    "HooksConfig",
    "JobConfig",
    "MetricsConfig",
    "ModelConfig",
    "MoeRouter",
    "NonFinitePolicy",
    "OptimizerConfig",
    "OptimizerName",
    "PipelineSchedule",
    "Precision",
    "Problem",
    "ProfilerConfig",
    "ResilienceConfig",
    "RopeScaling",
    "RopeScalingType",
    "RunConfig",
    "ScheduleName",
    "ScheduleSource",
    "SchedulerConfig",
    "SpikePolicy",
    "TrainConfig",
    "Verification",
    "VisionConfig",
    "VisionEncoderKind",
    "VlmArch",
]


@attrs.frozen
class JobConfig:
    """The whole run configuration: one attribute per TOML table."""

    run: RunConfig = attrs.Factory(RunConfig)
    model: ModelConfig = attrs.Factory(ModelConfig)
    train: TrainConfig = attrs.Factory(TrainConfig)
    optimizer: OptimizerConfig = attrs.Factory(OptimizerConfig)
    scheduler: SchedulerConfig = attrs.Factory(SchedulerConfig)
    data: DataConfig = attrs.Factory(DataConfig)
    eval: EvalConfig = attrs.Factory(EvalConfig)
    checkpoint: CheckpointConfig = attrs.Factory(CheckpointConfig)
    metrics: MetricsConfig = attrs.Factory(MetricsConfig)
    resilience: ResilienceConfig = attrs.Factory(ResilienceConfig)
    distributed: DistributedConfig = attrs.Factory(DistributedConfig)
    fault_tolerance: FaultToleranceConfig = attrs.Factory(FaultToleranceConfig)
    hooks: HooksConfig = attrs.Factory(HooksConfig)
    profiler: ProfilerConfig = attrs.Factory(ProfilerConfig)
    freeze: tuple[FreezeRule, ...] = ()  # [[freeze]]: which parameters train when
