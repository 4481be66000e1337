"""A CPU's peak FLOP/s for MFU: measured, and cached per machine.

A CPU has no datasheet peak that its matmuls reach, so forge measures one: the best rate of
square matmuls of a few sizes (256 to 2048), each repeated for a share of under a second. A
loaded machine only slows a matmul down, so the fastest one seen is the nearest to the peak.
The result is kept in ``cpu_peak_flops.json`` in forge's cache folder, one entry per CPU,
cores, threads, dtype and torch version, so later runs on the machine skip the measurement
and divide by the same figure. A cache that is missing, corrupt or unwritable never stops a
run: the peak is measured and the run goes on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from forge.cache import this_cache_dir, write_cache_file

MEASURE_SIZES = (256, 512, 1024, 2048)
MEASURE_BUDGET_S = 0.8  # all sizes together; a size that would not fit is skipped
MEASURE_REPS = 10  # timed matmuls per size at most: the small sizes leave time to the large
CACHE_FILE = "cpu_peak_flops.json"
CACHE_VERSION = 1


def matmul_rate(size: int, seconds: float) -> float:
    """FLOP/s of one ``size × size`` by ``size × size`` matmul that took ``seconds``."""
    return 2.0 * size**3 / seconds if seconds > 0 else 0.0


def best_peak(samples: Sequence[tuple[int, float]]) -> float:
    """The peak of timed matmuls ``(size, seconds)``: the best rate of any. A loaded machine
    only makes matmuls slower, so the fastest one is the nearest to the peak."""
    return max((matmul_rate(size, t) for size, t in samples), default=0.0)


def next_size_fits(seconds: float, size: int, next_size: int, remaining_s: float) -> bool:
    """Whether a warm-up and one timed matmul of ``next_size`` fit in ``remaining_s``, a
    ``size`` matmul having taken ``seconds`` (the cost grows as the cube of the size)."""
    return 2.0 * seconds * (next_size / size) ** 3 <= remaining_s


def measure_matmul_peak(
    dtype: torch.dtype,
    sizes: Sequence[int] = MEASURE_SIZES,
    budget_s: float = MEASURE_BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The best FLOP/s of square matmuls in ``dtype`` on this CPU: each size warmed up, then
    timed up to ``MEASURE_REPS`` times within its share of what is left of ``budget_s``; the
    sizes go up until the next one would overrun the budget."""
    deadline, samples = clock() + budget_s, []
    operands = torch.Generator().manual_seed(0)  # not the global one: a run's saved RNG
    for i, size in enumerate(sizes):  # state must not depend on whether the peak was cached
        a = torch.randn(size, size, dtype=dtype, generator=operands)
        b = torch.randn(size, size, dtype=dtype, generator=operands)
        torch.mm(a, b)  # warm-up: thread pool, kernels, caches
        stop = clock() + (deadline - clock()) / (len(sizes) - i)
        times: list[float] = []
        while not times or (len(times) < MEASURE_REPS and clock() < stop):
            start = clock()
            torch.mm(a, b)
            times.append(clock() - start)
        samples += [(size, t) for t in times]
        fastest = min(times)
        later = sizes[i + 1] if i + 1 < len(sizes) else None
        if later is None or not next_size_fits(fastest, size, later, deadline - clock()):
            break
    return best_peak(samples)


def cpu_identity(cpuinfo: str) -> tuple[str, str]:
    """The CPU's model name and a digest of its feature flags, from ``/proc/cpuinfo``'s text
    (virtual machines often name every CPU "Intel(R) Xeon(R) Processor": the flags tell an
    AVX2 host from an AMX one under a shared home directory)."""
    name, flags = "", ""
    for line in cpuinfo.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and not name:
            name = value
        elif key in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
    return name, hashlib.sha256(flags.encode()).hexdigest()[:12] if flags else "none"


def peak_cache_key(
    cpu: str, flags: str, cores: int, threads: int, dtype: torch.dtype, torch_version: str
) -> str:
    """The cache entry of one measurement: what its rate depends on (the CPU, the cores this
    process may use and torch's threads, the dtype, torch's kernels)."""
    machine = f"{cpu or 'unknown CPU'} | flags {flags} | {cores} cores | {threads} threads"
    return f"{machine} | {dtype} | torch {torch_version}"


def this_machine_key(dtype: torch.dtype, threads: int) -> str:
    """``peak_cache_key`` for this process running ``threads`` torch threads."""
    try:
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:  # no /proc (macOS): the platform's name for the CPU, no flags
        cpuinfo = ""
    name, flags = cpu_identity(cpuinfo)
    name = name or platform.processor() or platform.machine()
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return peak_cache_key(name, flags, cores, threads, dtype, torch.__version__)


def cached_peaks(path: pathlib.Path) -> dict[str, float]:
    """Every valid entry of the cache file; nothing from a missing, unreadable or corrupt one
    (a cache never stops a run: the peak is measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("peaks")
    if not isinstance(entries, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in entries.items()
        if type(v) in (int, float) and math.isfinite(v) and v > 0
    }


def write_cached_peak(path: pathlib.Path, key: str, flops: float) -> str | None:
    """Add ``key``'s peak to the cache file (``write_cache_file``: whole or not at all). None
    when written, else why not."""
    text = json.dumps({"version": CACHE_VERSION, "peaks": cached_peaks(path) | {key: flops}})
    return write_cache_file(path, text + "\n")


def raise_cached_peak(dtype: torch.dtype, flops: float) -> str | None:
    """Record ``flops`` as this CPU's peak in ``dtype`` where it beats the cached one (a run
    achieved more than a measurement on a loaded machine found): later runs start from it.
    None when recorded (or nothing to raise), else why not."""
    folder = this_cache_dir()
    if folder is None:
        return "no cache folder"
    path, key = folder / CACHE_FILE, this_machine_key(dtype, torch.get_num_threads())
    if cached_peaks(path).get(key, 0.0) >= flops:
        return None
    return write_cached_peak(path, key, flops)


@attrs.frozen
class CpuPeak:
    """A CPU's matmul peak FLOP/s, whether it came from the cache file, and what to say about
    it: the cache file, or where the measurement was (or could not be) cached."""

    flops: float
    from_cache: bool
    detail: str


def cpu_peak(dtype: torch.dtype) -> CpuPeak:
    """This CPU's matmul peak in ``dtype`` with its current thread count (see
    ``_cpu_peak``)."""
    return _cpu_peak(dtype, torch.get_num_threads())


@functools.cache  # once per process: a run logs one peak, and its tests read the same one
def _cpu_peak(dtype: torch.dtype, threads: int) -> CpuPeak:
    """From the cache file, else measured now and cached; a cache that cannot be read or
    written costs only the measurement."""
    folder = this_cache_dir()
    path = None if folder is None else folder / CACHE_FILE
    key = this_machine_key(dtype, threads)
    cached = None if path is None else cached_peaks(path).get(key)
    if path is not None and cached is not None:
        return CpuPeak(cached, True, str(path))
    flops = measure_matmul_peak(dtype)
    failure = "no cache folder" if path is None else write_cached_peak(path, key, flops)
    detail = f"cached in {path}" if failure is None else f"not cached: {failure}"
    return CpuPeak(flops, False, detail)
