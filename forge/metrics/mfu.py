"""A run's throughput metrics on rank 0: the peak its MFU is against, looked up once (on a
CPU: read from the cache or measured) at the first log, and an MFU clamped at 1 reported
once (the clamp raises a CPU's cached peak, so that later runs start from it)."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from forge.config.sections import Precision
from forge.metrics.flops import (
    PeakFlops,
    PeakSource,
    device_name,
    device_peak,
    peak_line,
    raise_cpu_peak,
    throughput,
    under_measured_line,
)


class MfuMeter:
    """``tokens_per_sec_per_device``, ``tflops`` and ``mfu`` of each logged step."""

    def __init__(
        self,
        device: torch.device,
        precision: Precision,
        world_size: int,
        flops_per_token: float,
        stream: TextIO | None = None,
    ) -> None:
        self.device = device
        self.precision = precision
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.stream = stream
        self._peak: tuple[PeakFlops | None] | None = None  # (peak,) after the first log
        self._warned = False

    def peak(self) -> PeakFlops | None:
        """The peak, looked up at the first call, which prints where it came from."""
        if self._peak is None:
            peak = device_peak(self.device, self.precision)
            self._peak = (peak,)
            self._say(peak_line(peak, device_name(self.device)))
        return self._peak[0]

    def record(self, tokens_per_sec: float) -> dict[str, float]:
        """The throughput metrics of a step at the whole job's ``tokens_per_sec``."""
        peak = self.peak()
        flops = None if peak is None else peak.flops
        result = throughput(tokens_per_sec, self.world_size, self.flops_per_token, flops)
        clamped = result.mfu is not None and result.mfu.under_measured
        if peak is not None and clamped and not self._warned:
            self._warned = True
            self._say(f"warning: {under_measured_line(peak, result.achieved)}")
            if peak.source is not PeakSource.DATASHEET:  # a CPU's: later runs start from it
                raise_cpu_peak(self.precision, result.achieved)
        return result.record()

    def _say(self, line: str) -> None:
        print(f"[forge] {line}", file=self.stream or sys.stderr, flush=True)
