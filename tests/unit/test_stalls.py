"""A stalled or dead peer, named in one line: which collective failed, decided from a
flight-recorder dump (tables of NCCL-like and gloo-like dumps), and the NCCL settings."""

from __future__ import annotations

import pytest

from forge.parallel.mesh import CLEAN_UP_ONLY, nccl_environment
from forge.resilience.stalls import Collective, backend_reason, failed_collective, stall_line


def entry(record: int, seq: int, name: str, state: str = "scheduled", pg: str = "0") -> dict:
    return {"record_id": record, "collective_seq_id": seq, "profiling_name": name,
            "state": state, "process_group": [pg, "default_pg" if pg == "0" else f"group_{pg}"]}  # fmt: skip


def trace(entries: list[dict], done: dict[str, int]) -> dict:
    status = {pg: {"last_completed_collective": str(n)} for pg, n in done.items()}
    return {"entries": entries, "pg_status": status, "pg_config": {"default_pg": {"ranks": "[0, 1]"}}}  # fmt: skip


@pytest.mark.parametrize(
    ("dump", "expected"),
    [
        # NCCL: the timed-out all-gather is still started, past the last completed one
        (
            trace(
                [
                    entry(0, 7, "nccl:all_reduce", "completed"),
                    entry(1, 8, "nccl:_allgather_base", "started"),
                    entry(2, 9, "nccl:reduce_scatter"),
                ],
                {"0": 7},
            ),
            Collective("_allgather_base", 8, "[0, 1]"),
        ),
        # gloo: a failed collective counts as completed: the newest one is the failure
        (
            trace([entry(0, 34, "gloo:all_reduce"), entry(1, 35, "gloo:all_gather")], {"0": 35}),
            Collective("all_gather", 35, "[0, 1]"),
        ),
        # the ring is ordered by record, not by list position
        (
            trace([entry(5, 12, "gloo:broadcast"), entry(4, 11, "gloo:all_reduce")], {"0": 12}),
            Collective("broadcast", 12, "[0, 1]"),
        ),
        # another group's collective stalled while the default group completed everything
        (
            trace(
                [
                    entry(0, 3, "nccl:all_reduce", "completed"),
                    entry(1, 1, "nccl:send", "started", pg="2"),
                ],
                {"0": 3, "2": 0},
            ),
            Collective("send", 1, ""),
        ),
        ({}, None),  # no flight recorder: nothing to name
        (trace([], {}), None),
    ],
    ids=["nccl-started", "gloo-newest", "record-order", "other-group", "no-dump", "empty"],
)
def test_the_failed_collective_is_read_from_the_flight_recorder(dump, expected):
    assert failed_collective(dump) == expected


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed "
            "out waiting 4000ms for send operation to complete",
            "Timed out waiting 4000ms for send operation to complete",
        ),
        (
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:57549. This is typically caused by a remote worker crashing. GLHF!",
            "Connection closed by peer [127.0.0.1]:57549",
        ),
        (
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8, "
            "OpType=ALLGATHER)\nran for 600005 milliseconds",
            "[Rank 1] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=8, OpType=ALLGATHER)",
        ),
        ("", "no message"),
    ],
    ids=["gloo-timeout", "gloo-peer-gone", "nccl-watchdog", "empty"],
)
def test_the_backends_error_becomes_one_short_clause(message, reason):
    assert backend_reason(message) == reason


@pytest.mark.parametrize(
    ("collective", "names"),
    [
        (Collective("all_gather", 35, "[0, 1]"), "all_gather #35 over ranks [0, 1] in step 3"),
        (None, "a collective in step 3"),
    ],
)
def test_the_stall_line_names_rank_collective_step_and_key(collective, names):
    line = stall_line(1, 3, collective, 4.0, "Timed out waiting 4000ms\nsecond line")
    assert "\n" not in line
    assert line.startswith(f"rank 1: {names} failed or outlasted distributed.timeout_s=4: ")
    assert "(Timed out waiting 4000ms)" in line and "HEALTH_FAILURE" in line


@pytest.mark.parametrize(
    ("env", "set_"),
    [
        (
            {},
            {
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": CLEAN_UP_ONLY,
                "TORCH_FR_BUFFER_SIZE": "2000",
                "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1260",
            },
        ),
        (
            {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_FR_BUFFER_SIZE": "0"},
            {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1260"},
        ),
    ],
)
def test_nccl_aborts_without_killing_and_records_collectives(env, set_):
    assert nccl_environment(env, timeout_s=600) == set_
