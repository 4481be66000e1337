"""Memory metrics of the training process: CUDA allocator peaks, or the process's RSS."""

from __future__ import annotations

import os
import resource

import torch

GIB = 2**30


def rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``), else its lifetime peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident set size: ``VmHWM`` from ``/proc`` (reset by ``exec``,
    unlike ``ru_maxrss``, which a child inherits from the parent it forked from), else
    ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def memory_record(device: torch.device) -> dict[str, float]:
    """``memory/*`` for the interval since the last call, in GiB: on CUDA the peak allocated
    (then reset, so each logged interval shows its own peak) and the reserved memory; on CPU
    the process's RSS and its lifetime peak."""
    if device.type == "cuda":
        record = {
            "memory/peak_allocated_gb": torch.cuda.max_memory_allocated(device) / GIB,
            "memory/reserved_gb": torch.cuda.memory_reserved(device) / GIB,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return record
    rss = rss_bytes()
    peak = max(rss, peak_rss_bytes())  # the kernel updates the high-water mark lazily
    return {"memory/rss_gb": rss / GIB, "memory/peak_rss_gb": peak / GIB}
