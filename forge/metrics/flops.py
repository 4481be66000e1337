"""Model FLOPs per token, accelerator peaks, and the utilisation (MFU) they give.

``flops_per_token`` is the usual training estimate (Kaplan et al.; PaLM appendix B): a
token's forward and backward through a weight matrix cost 6 FLOPs per parameter, and the
attention scores and their weighted sum add ``12 × n_layers × dim × seq_len`` (full, not
causal, attention, as PaLM counts it). The parameters counted are those a token passes
through: every block, the final norm and the output projection (also when it is tied to the
embedding), but not the embedding lookup, which is a gather.

The peak MFU divides by is a datasheet figure for a known accelerator. A CPU has none: its
peak is the best rate over a few matmul sizes and repetitions, measured once per machine,
dtype, thread count and torch version and kept in a small JSON file in forge's cache folder
(``forge.metrics.cpu_peak``). An MFU above 1 only says the peak was measured low: it is
reported as 1.
"""

from __future__ import annotations

import enum
import math

import attrs
import torch

from forge.config.sections import ModelConfig, Precision
from forge.config.shapes import (
    ROUTED_EXPERTS,
    ROUTER_BIAS,
    block_shapes,
    feed_forward_shapes,
)
from forge.metrics.cpu_peak import MEASURE_SIZES, cpu_peak, raise_cached_peak


def parameters(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], active: bool) -> int:
    """The parameters of ``shapes`` (tensors of ``forge.config.shapes``) a token multiplies
    with: the router's balancing bias aside (a buffer, added), and with ``active`` only the
    ``top_k`` routed experts a token passes through."""
    total = 0
    for name, shape in shapes.items():
        if name == ROUTER_BIAS:
            continue
        if active and name in ROUTED_EXPERTS:  # (E, in, out): top_k of the E
            shape = (cfg.moe_top_k, *shape[1:])
        total += math.prod(shape)
    return total


def feed_forward_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Parameters of block ``layer``'s feed-forward: the dense SwiGLU, or a mixture of
    experts' router, routed experts and shared experts."""
    return parameters(cfg, feed_forward_shapes(cfg, layer), active)


def block_parameters(cfg: ModelConfig, layer: int = 0, active: bool = False) -> int:
    """Parameters of block ``layer``: attention (and its q/k norms), its feed-forward, two
    norms."""
    return parameters(cfg, block_shapes(cfg, layer), active)


def largest_block_parameters(cfg: ModelConfig) -> int:
    """The parameters of the largest block (a mixture of experts' when there is one)."""
    return max(block_parameters(cfg, i) for i in range(cfg.n_layers))


def non_embedding_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """Parameters a token's forward pass multiplies with: blocks, final norm, output head;
    with ``active``, only the experts a token is routed to."""
    blocks = sum(block_parameters(cfg, i, active) for i in range(cfg.n_layers))
    return blocks + cfg.dim + cfg.vocab_size * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at ``seq_len``, counting the active
    parameters of a mixture of experts (the ``top_k`` routed experts a token goes through)
    and every multi-token depth (its block, projection and a pass through the head)."""
    # a multi-token depth: its own tensors (active experts only) and, again, the output head
    depths = sum(
        parameters(cfg, block_shapes(cfg, cfg.n_layers + k - 1), active=True)
        for k in range(1, cfg.mtp_depth + 1)
    )
    depths += cfg.mtp_depth * (3 * cfg.dim + 2 * cfg.dim * cfg.dim + cfg.vocab_size * cfg.dim)
    matmuls = 6.0 * (non_embedding_parameters(cfg, active=True) + depths)
    # scores and their weighted sum: 2 × (q·k + p·v) per head channel, × 3 with backward
    blocks = cfg.n_layers + cfg.mtp_depth
    qk, v = (cfg.mla.qk_dim, cfg.mla.v_dim) if cfg.mla is not None else (cfg.head_size,) * 2
    return matmuls + 6.0 * blocks * cfg.n_heads * (qk + v) * seq_len


@attrs.frozen
class Peak:
    """An accelerator's dense peak FLOP/s in bf16 and in fp32 (vendor datasheets; no sparsity,
    fp32 without TF32)."""

    marker: str  # a substring of the device name, matched case-insensitively
    bf16: float
    fp32: float


# The longest marker contained in the device name wins: "NVIDIA H100 PCIe" is the PCIe card,
# not the SXM one that a bare "H100" (e.g. "NVIDIA H100 80GB HBM3") stands for.
PEAKS: tuple[Peak, ...] = (
    Peak("H100", 989e12, 67e12),  # SXM5: "NVIDIA H100 80GB HBM3"
    Peak("H100 SXM", 989e12, 67e12),
    Peak("H100 PCIe", 756e12, 51e12),
    Peak("H100 NVL", 835e12, 60e12),
    Peak("H200", 989e12, 67e12),  # SXM
    Peak("H200 NVL", 835e12, 60e12),
    Peak("H800", 989e12, 67e12),
    Peak("H800 PCIe", 756e12, 51e12),
    Peak("GH200", 989e12, 67e12),
    Peak("B200", 2250e12, 80e12),
    Peak("A100", 312e12, 19.5e12),  # 40 and 80 GB, PCIe and SXM4: the same dense peaks
    Peak("A100-SXM4", 312e12, 19.5e12),
    Peak("A100-PCIE", 312e12, 19.5e12),  # "NVIDIA A100-PCIE-40GB"
    Peak("A100 80GB PCIe", 312e12, 19.5e12),
    Peak("A800", 312e12, 19.5e12),
    Peak("L40S", 362e12, 91.6e12),
    Peak("MI300X", 1307.4e12, 163.4e12),
    Peak("MI325X", 1307.4e12, 163.4e12),
    Peak("MI300A", 980.6e12, 122.6e12),
)


def table_peak(device_name: str) -> Peak | None:
    """The table row for a device name (the longest marker it contains), None if unknown."""
    name = device_name.lower()
    found = [p for p in PEAKS if p.marker.lower() in name]
    return max(found, key=lambda p: len(p.marker), default=None)


def table_peak_flops(device_name: str, dtype: Precision) -> float | None:
    """The peak FLOP/s of a known accelerator for compute in ``dtype``; None if unknown."""
    peak = table_peak(device_name)
    if peak is None:
        return None
    return peak.bf16 if dtype is Precision.BF16 else peak.fp32


class PeakSource(enum.Enum):
    """Where a peak came from."""

    DATASHEET = "the datasheet table"
    CACHE = "the cache file"
    MEASURED = "a measurement"


@attrs.frozen
class PeakFlops:
    """A peak FLOP/s and where it came from; ``detail`` names the device, the cache file, or
    why a measurement could not be cached."""

    flops: float
    source: PeakSource
    detail: str


def peak_line(peak: PeakFlops | None, device_name: str) -> str:
    """The one line a run logs about the peak its MFU is against."""
    if peak is None:
        return f"mfu: no peak known for {device_name!r}; tflops is logged, mfu is not"
    rate = f"mfu peak: {peak.flops / 1e12:,.2f} TFLOP/s"
    if peak.source is PeakSource.DATASHEET:
        return f"{rate} from the datasheet table ({peak.detail})"
    if peak.source is PeakSource.CACHE:
        return f"{rate} from the cache file {peak.detail} (measured on this machine before)"
    sizes = ", ".join(str(n) for n in MEASURE_SIZES)
    return f"{rate} measured now (the best of {sizes}-square matmuls); {peak.detail}"


@attrs.frozen
class Mfu:
    """An MFU as reported (at most 1) and whether the achieved rate beat the peak: then the
    peak is too low (a CPU's, measured on a loaded machine) or the FLOPs are overcounted, and
    the figure means nothing."""

    value: float
    under_measured: bool


def mfu_of(achieved: float, peak: float) -> Mfu:
    """The MFU of ``achieved`` FLOP/s against a positive ``peak``, clamped at 1."""
    ratio = achieved / peak
    return Mfu(min(ratio, 1.0), ratio > 1.0)


@attrs.frozen
class Throughput:
    """Per-device throughput of a step: tokens/s, achieved FLOP/s, MFU when a peak is known."""

    tokens_per_sec_per_device: float
    achieved: float
    mfu: Mfu | None

    def record(self) -> dict[str, float]:
        """The metrics: ``tokens_per_sec_per_device``, ``tflops`` and (with a peak) ``mfu``."""
        record = {"tokens_per_sec_per_device": self.tokens_per_sec_per_device}
        record["tflops"] = self.achieved / 1e12
        if self.mfu is not None:
            record["mfu"] = self.mfu.value
        return record


def throughput(
    tokens_per_sec: float, world_size: int, flops_per_token: float, peak: float | None
) -> Throughput:
    """Per-device throughput. ``tokens_per_sec`` is the whole job's; every device shares the
    model FLOPs of every token (data parallel ranks take different tokens, TP and PP ranks
    parts of the same ones)."""
    per_device = tokens_per_sec / world_size
    achieved = per_device * flops_per_token
    mfu = mfu_of(achieved, peak) if peak is not None and peak > 0 else None
    return Throughput(per_device, achieved, mfu)


def throughput_record(
    tokens_per_sec: float, world_size: int, flops_per_token: float, peak: float | None
) -> dict[str, float]:
    """``throughput(...).record()``: tokens/s and TFLOP/s per device, MFU with a ``peak``."""
    return throughput(tokens_per_sec, world_size, flops_per_token, peak).record()


def measured_matmul_flops(dtype: torch.dtype) -> float:
    """The CPU peak MFU is measured against in ``dtype``: ``cpu_peak(dtype).flops``."""
    return cpu_peak(dtype).flops


def device_name(device: torch.device) -> str:
    """The accelerator's name (a CUDA device's product name), else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_peak(device: torch.device, dtype: Precision) -> PeakFlops | None:
    """The peak MFU is measured against: the datasheet's for a known accelerator, the cached
    or measured matmul peak on a CPU, None for an unknown accelerator (then no ``mfu``)."""
    if device.type == "cuda":
        name = device_name(device)
        flops = table_peak_flops(name, dtype)
        return None if flops is None else PeakFlops(flops, PeakSource.DATASHEET, name)
    if device.type == "cpu":
        cpu = cpu_peak(torch.bfloat16 if dtype is Precision.BF16 else torch.float32)
        return PeakFlops(
            cpu.flops, PeakSource.CACHE if cpu.from_cache else PeakSource.MEASURED, cpu.detail
        )
    return None


def raise_cpu_peak(precision: Precision, achieved: float) -> str | None:
    """Cache ``achieved`` as this CPU's peak for compute in ``precision`` where it beats the
    cached one (``raise_cached_peak``)."""
    dtype = torch.bfloat16 if precision is Precision.BF16 else torch.float32
    return raise_cached_peak(dtype, achieved)


def device_peak_flops(device: torch.device, dtype: Precision) -> float | None:
    """``device_peak``'s FLOP/s."""
    peak = device_peak(device, dtype)
    return None if peak is None else peak.flops


def under_measured_line(peak: PeakFlops, achieved: float) -> str:
    """The warning a run prints once when its MFU is clamped at 1."""
    line = (
        f"achieved {achieved / 1e12:,.2f} TFLOP/s per device is above the peak "
        f"({peak.flops / 1e12:,.2f} TFLOP/s, from {peak.source.value}): mfu is reported as 1.0"
    )
    if peak.source in (PeakSource.CACHE, PeakSource.MEASURED):
        return (
            f"{line}; the peak was measured low (a loaded machine?): the achieved rate is "
            "cached as this CPU's peak for later runs"
        )
    return f"{line}; the FLOPs per token overcount this model's work"
