"""Step metrics and their sinks."""

from forge.metrics.sinks import JsonlSink, MetricsSink, StdoutSink, trim_records_after

__all__ = ["JsonlSink", "MetricsSink", "StdoutSink", "trim_records_after"]
