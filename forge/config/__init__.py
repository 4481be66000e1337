"""Typed run configuration: attrs sections, TOML + CLI loading, validation."""

from forge.config.loader import (
    ConfigError,
    LoadedConfig,
    load_config,
    structure_config,
    unstructure_config,
)
from forge.config.sections import (
    CheckpointConfig,
    DataConfig,
    DynamicWindow,
    EvalConfig,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    NonFinitePolicy,
    OptimizerConfig,
    Precision,
    ResilienceConfig,
    RunConfig,
    ScheduleName,
    SchedulerConfig,
    TrainConfig,
)
from forge.config.toml_writer import dumps_toml

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DynamicWindow",
    "EvalConfig",
    "JobConfig",
    "LoadedConfig",
    "MetricsConfig",
    "ModelConfig",
    "NonFinitePolicy",
    "OptimizerConfig",
    "Precision",
    "ResilienceConfig",
    "RunConfig",
    "ScheduleName",
    "SchedulerConfig",
    "TrainConfig",
    "dumps_toml",
    "load_config",
    "structure_config",
    "unstructure_config",
]
