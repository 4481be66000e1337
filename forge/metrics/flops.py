"""Model FLOPs per token, accelerator peaks, and the utilisation (MFU) they give.

``flops_per_token`` is the usual training estimate (Kaplan et al.; PaLM appendix B): a
token's forward and backward through a weight matrix cost 6 FLOPs per parameter, and the
attention scores and their weighted sum add ``12 × n_layers × dim × seq_len`` (full, not
causal, attention, as PaLM counts it). The parameters counted are those a token passes
through: every block, the final norm and the output projection (also when it is tied to the
embedding), but not the embedding lookup, which is a gather.
"""

from __future__ import annotations

import functools
import time

import attrs
import torch

from forge.config.sections import ModelConfig, Precision


def feed_forward_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Parameters of block ``layer``'s feed-forward: the dense SwiGLU, or a mixture of
    experts' router, routed experts (only the ``top_k`` a token passes through when
    ``active``) and shared experts."""
    if not cfg.is_moe_layer(layer):
        return 3 * cfg.dim * cfg.hidden_dim
    expert = 3 * cfg.dim * cfg.expert_hidden_dim
    routed = cfg.moe_top_k if active else cfg.moe_num_experts
    return cfg.dim * cfg.moe_num_experts + (routed + cfg.moe_shared_experts) * expert


def block_parameters(cfg: ModelConfig, layer: int = 0, active: bool = False) -> int:
    """Parameters of block ``layer``: attention (and its q/k norms), its feed-forward (see
    ``feed_forward_parameters``), two norms."""
    head_dim = cfg.dim // cfg.n_heads
    attention = 2 * cfg.dim * cfg.n_heads * head_dim + 2 * cfg.dim * cfg.kv_heads * head_dim
    qk_norms = 2 * head_dim if cfg.qk_norm else 0
    feed_forward = feed_forward_parameters(cfg, layer, active)
    return attention + qk_norms + feed_forward + 2 * cfg.dim


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
    parameters of a mixture of experts (the ``top_k`` routed experts a token goes through)."""
    matmuls = 6.0 * non_embedding_parameters(cfg, active=True)
    return matmuls + 12.0 * cfg.n_layers * cfg.dim * seq_len


@attrs.frozen
class Peak:
    """An accelerator's dense peak FLOP/s in bf16 and in fp32 (vendor datasheets; no sparsity,
    fp32 without TF32)."""

    marker: str  # a substring of the device name, matched case-insensitively
    bf16: float
    fp32: float


# Most specific first: "H100 PCIe" and "H100 NVL" must match before "H100".
PEAKS: tuple[Peak, ...] = (
    Peak("H100 PCIe", 756e12, 51e12),
    Peak("H100 NVL", 835e12, 60e12),
    Peak("H100", 989e12, 67e12),
    Peak("H200", 989e12, 67e12),
    Peak("H800", 989e12, 67e12),
    Peak("GH200", 989e12, 67e12),
    Peak("B200", 2250e12, 80e12),
    Peak("A100", 312e12, 19.5e12),
    Peak("A800", 312e12, 19.5e12),
    Peak("MI300X", 1307.4e12, 163.4e12),
    Peak("MI325X", 1307.4e12, 163.4e12),
    Peak("MI300A", 980.6e12, 122.6e12),
)


def table_peak_flops(device_name: str, dtype: Precision) -> float | None:
    """The peak FLOP/s of a known accelerator for compute in ``dtype``; None if unknown."""
    name = device_name.lower()
    for peak in sorted(PEAKS, key=lambda p: -len(p.marker)):  # longest marker wins
        if peak.marker.lower() in name:
            return peak.bf16 if dtype is Precision.BF16 else peak.fp32
    return None


@functools.cache
def measured_matmul_flops(dtype: torch.dtype, size: int = 512, seconds: float = 0.05) -> float:
    """The best FLOP/s of repeated ``size × size`` matmuls in ``dtype`` on the CPU: forge's
    stand-in for a peak where no datasheet applies (a measurement, not a spec; once per
    process)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool, kernels
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def device_peak_flops(device: torch.device, dtype: Precision) -> float | None:
    """The peak MFU is measured against: the datasheet's for a known accelerator, a measured
    matmul peak on the CPU, None for an unknown accelerator (then no ``mfu`` is logged)."""
    if device.type == "cuda":
        return table_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return measured_matmul_flops(torch.bfloat16 if dtype is Precision.BF16 else torch.float32)
    return None


def throughput_record(
    tokens_per_sec: float, world_size: int, flops_per_token: float, peak: float | None
) -> dict[str, float]:
    """Per-device throughput of a step: tokens/s, achieved TFLOP/s and, with a ``peak``, MFU.

    ``tokens_per_sec`` is the whole job's; every device shares the model FLOPs of every token
    (data parallel ranks take different tokens, TP and PP ranks parts of the same ones).
    """
    per_device = tokens_per_sec / world_size
    achieved = per_device * flops_per_token
    record = {"tokens_per_sec_per_device": per_device, "tflops": achieved / 1e12}
    if peak is not None and peak > 0:
        record["mfu"] = achieved / peak
    return record
