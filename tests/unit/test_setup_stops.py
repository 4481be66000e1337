"""What stops set-up: a signal (``SetupInterrupted``, its exit code and line) and a store that
does not answer (a bounded wait, the endpoint it names). The processes are in
``tests/e2e/test_setup_signals.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

import pytest

from forge.checkpoint.object_path import (
    ObjectPath,
    StoreTimeoutError,
    object_path,
    result_while_answering,
    store_endpoint,
)
from forge.errors import UserInputError
from forge.resilience.signals import (
    SetupInterrupted,
    ShutdownFlag,
    setup_exit_code,
    setup_stop_line,
)
from forge.types import ExitCode

T = TypeVar("T")


@pytest.mark.parametrize(
    ("sig", "code"),
    [
        (signal.SIGTERM, ExitCode.SHUTDOWN),  # a scheduler: requeue
        (signal.SIGUSR1, ExitCode.SHUTDOWN),  # SLURM's warning before the time limit
        (signal.SIGINT, ExitCode.INTERRUPTED),  # Ctrl-C: a person stopped it
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_a_signal_during_set_up_exits_with_its_code(sig, code):
    assert setup_exit_code(sig) == code
    assert setup_stop_line(sig).startswith(f"interrupted ({sig.name}) during set-up: stopped")


SET, ONE = {"AWS_ENDPOINT_URL": "http://env:1"}, {"endpoint_url": "http://options:2"}

# (case, protocol, storage options, environment, the endpoint named)
ENDPOINTS = [
    ("the storage options'", "s3", ONE, SET, "http://options:2"),
    ("in client_kwargs", "s3", {"client_kwargs": {"endpoint_url": "http://client:3"}}, SET, "http://client:3"),
    ("the environment's", "s3", {}, SET, "http://env:1"),
    ("S3's own variable first", "s3a", {}, {**SET, "AWS_ENDPOINT_URL_S3": "http://s3:4"}, "http://s3:4"),
    ("AWS's default", "s3", {}, {}, None),
    ("no AWS variable for GCS", "gs", {}, SET, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("protocol", "options", "env", "endpoint"),
    [c[1:] for c in ENDPOINTS],
    ids=[c[0] for c in ENDPOINTS],
)
def test_the_endpoint_a_store_that_does_not_answer_is_named_by(protocol, options, env, endpoint):
    assert store_endpoint(protocol, options, env) == endpoint


def test_a_call_the_store_does_not_answer_is_given_up_after_the_timeout(monkeypatch):
    """The call is given up on, named as an OSError (its callers' handling) and as bad input
    (a script's one line); a call that answers in time returns, or raises its own error."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    path = object_path("s3://bucket/run", timeout_s=0.2)
    hung = threading.Event()
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        path.answer(hung.wait)
    assert 0.2 <= time.monotonic() - start < 1
    assert isinstance(info.value, OSError) and isinstance(info.value, UserInputError)
    assert info.value.lines[0].startswith(
        "s3://bucket/run: the store at http://127.0.0.1:9 did not answer within "
        "checkpoint.storage_timeout_s=0.2 s; "
    )
    hung.set()
    assert path.answer(lambda: 7) == 7
    with pytest.raises(TimeoutError) as own:  # the call's own timeout is not the store's
        path.answer(lambda: (_ for _ in ()).throw(TimeoutError("its own")))
    assert not isinstance(own.value, StoreTimeoutError)


def test_a_signal_stops_set_up_where_it_is_and_asks_for_a_save_once_set_up_is_done():
    flag = ShutdownFlag(setting_up=True).install()
    try:
        with pytest.raises(SetupInterrupted) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)  # the handler raises on the main thread, here
        assert info.value.exit_code == ExitCode.SHUTDOWN
    finally:
        flag.uninstall()
    flag = ShutdownFlag(setting_up=True).install()
    try:
        flag.setup_done()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 2
        while not flag.requested() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flag.received == signal.SIGTERM  # the loop's flag: nothing raised
    finally:
        flag.uninstall()


# (case, forge's handler in place, the signals the process blocks, whether they reach it)
REACH = [
    ("forge's handler, nothing blocked", True, (), True),
    ("another handler in its place", False, (), False),
    ("SIGUSR1 blocked by the process", True, (signal.SIGUSR1,), False),
    ("SIGTERM blocked by the process", True, (signal.SIGTERM,), False),
    ("an unrelated signal blocked", True, (signal.SIGHUP,), True),
]


@pytest.mark.parametrize(
    "handled,blocked,reaches", [r[1:] for r in REACH], ids=[r[0] for r in REACH]
)
def test_the_start_knows_whether_shutdown_signals_reach_its_handler(handled, blocked, reaches):
    flag = ShutdownFlag(setting_up=True).install()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        if not handled:
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        assert flag.reaches() is reaches
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        flag.uninstall()


def hangs(path: ObjectPath) -> bool:
    return path.answer(threading.Event().wait)


def refuses(path: ObjectPath) -> bool:
    raise OSError("ClientError: 503 SlowDown")


def bounded(call: Callable[[], T], limit_s: float = 10.0) -> T:
    """``call()``'s result or exception; a call still waiting after ``limit_s`` fails the
    test then (a wait that forgot its store would otherwise hang it until pytest's timeout)."""
    box: futures.Future[T] = futures.Future()

    def run() -> None:
        try:
            box.set_result(call())
        except BaseException as exc:  # handed to the test as it was raised
            box.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    if not futures.wait([box], timeout=limit_s).done:
        pytest.fail(f"still waiting after {limit_s} s")
    return box.result()


# (case, where the write goes, how the store answers the loop's question, the write's time,
# what the wait gives)
WAITS = [
    ("a store that answers: a slow write waited for in full", "s3", lambda p: True, 0.5, 7),
    ("a store that answers with an error: the write's own end", "s3", refuses, 0.5, 7),
    ("a store that stopped answering: named, not waited for", "s3", hangs, None, "timeout"),
    ("a local folder: waited for plainly", "local", hangs, 0.5, 7),
    (
        "a write failing on a timeout of its own: raised, not waited on",
        "s3",
        lambda p: True,
        0.3,
        "own",
    ),
]


@pytest.mark.parametrize(
    "where,answers,write_s,expected", [w[1:] for w in WAITS], ids=[w[0] for w in WAITS]
)
def test_a_save_in_flight_is_waited_for_while_its_store_answers(
    monkeypatch, tmp_path, where, answers, write_s, expected
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(ObjectPath, "exists", answers)
    path = object_path("s3://bucket/run", timeout_s=0.1) if where == "s3" else tmp_path
    write: futures.Future[int] = futures.Future()
    start = time.monotonic()
    if write_s is not None:
        outcome = (
            (write.set_exception, TimeoutError("its own"))
            if expected == "own"
            else (write.set_result, 7)
        )
        threading.Timer(write_s, outcome[0], (outcome[1],)).start()

    def wait() -> int:
        return result_while_answering(write, path)

    if expected == "timeout":
        with pytest.raises(StoreTimeoutError):
            bounded(wait)
        assert time.monotonic() - start < 1  # two timeouts and the slices between
    elif expected == "own":
        with pytest.raises(TimeoutError) as own:
            bounded(wait)
        assert not isinstance(own.value, StoreTimeoutError)
        assert time.monotonic() - start < 1
    else:
        assert bounded(wait) == expected
        assert write_s is not None and time.monotonic() - start >= write_s
