"""A stalled or dead peer, named: which collective never completed, on which rank, in one line.

Both backends bound every collective by ``distributed.timeout_s``: gloo raises when an
operation times out or a peer's connection closes; NCCL's watchdog aborts the communicators
after the same timeout (``forge.parallel.mesh.nccl_environment``: abort, do not kill the
process), so that the
step's next collective raises instead of the watchdog ending the process. Either way the step
becomes a health failure (``forge.resilience.health``) and the run ends HEALTH_FAILURE
(exit 4). torch's flight recorder (``TORCH_FR_BUFFER_SIZE``) keeps the last collectives of
every group; the first one not completed is the one the line names (``failed_collective``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs


@attrs.frozen
class Collective:
    """One collective the flight recorder saw: its name (``all_reduce``), its sequence number
    in its group, and the group's ranks."""

    name: str
    seq: int
    ranks: str = ""


def failed_collective(trace: Mapping[str, Any]) -> Collective | None:
    """The collective a flight-recorder dump (``_dump_fr_trace_json``'s, parsed) says failed:
    the oldest one not completed (NCCL: a timed-out collective stays started), else the
    newest one this rank entered (gloo counts a failed collective as completed; the step
    stops at its first failure); None when nothing was recorded."""
    entries = sorted(trace.get("entries", []), key=lambda e: int(e.get("record_id", 0)))
    status = trace.get("pg_status", {})
    for entry in entries:
        group = str(entry.get("process_group", [""])[0])
        done = int(status.get(group, {}).get("last_completed_collective", -1))
        if entry.get("state") != "completed" and int(entry.get("collective_seq_id", 0)) > done:
            return collective_of(entry, trace)
    return collective_of(entries[-1], trace) if entries else None


def collective_of(entry: Mapping[str, Any], trace: Mapping[str, Any]) -> Collective:
    """One flight-recorder entry as a ``Collective`` (its group's ranks where recorded)."""
    group = [str(g) for g in entry.get("process_group", ["", ""])] + [""]
    configs = trace.get("pg_config", {})
    config = configs.get(group[1]) or configs.get(group[0]) or {}
    name = str(entry.get("profiling_name", "?")).split(":")[-1]
    return Collective(name, int(entry.get("collective_seq_id", 0)), str(config.get("ranks", "")))


def backend_reason(message: str) -> str:
    """The backend's error as one short clause: the first line, without gloo's source
    location prefix (``[.../pair.cc:553] ``) and its closing advice."""
    first = message.strip().splitlines()[0] if message.strip() else "no message"
    first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". This is typically")[0].rstrip(".")


def stall_line(
    rank: int, step: int, collective: Collective | None, timeout_s: float, message: str
) -> str:
    """The one line a rank prints when a collective of ``step`` failed or timed out."""
    what = "a collective"
    if collective is not None:
        what = f"{collective.name} #{collective.seq}"
        if collective.ranks:
            what += f" over ranks {collective.ranks}"
    return (
        f"rank {rank}: {what} in step {step} failed or outlasted distributed.timeout_s="
        f"{timeout_s:g}: a peer is stalled or dead ({backend_reason(message)}); the run ends "
        "HEALTH_FAILURE: check the other ranks' logs, then resume"
    )


def flight_recorder_trace() -> dict[str, Any]:
    """This process's flight-recorder dump, parsed: NCCL's own recorder where this torch has
    NCCL and it recorded anything (a CUDA build), else the one gloo records into; empty when
    neither recorded anything."""
    import torch._C._distributed_c10d as c10d

    for dump in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        try:
            trace = json.loads(getattr(c10d, dump)(True, False))  # collectives, not only active
        except Exception:  # a diagnostic only: never a second failure on the way out
            continue
        if trace.get("entries"):
            return trace
    return {}
