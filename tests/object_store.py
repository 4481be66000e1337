"""A real S3-compatible endpoint for the tests: moto's server, started on 127.0.0.1 by the
first test that needs it (once per worker) and stopped at the end of the session. The
tests drive it through s3fs, exactly as AWS would be driven: endpoint and credentials in the
standard AWS variables."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

ENV = {
    "AWS_ACCESS_KEY_ID": "forge-test",
    "AWS_SECRET_ACCESS_KEY": "forge-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A moto S3 server on a free local port; yields its endpoint URL."""
    with moto_process(extra_env) as (endpoint, _):
        yield endpoint


@contextlib.contextmanager
def moto_process(
    extra_env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A moto S3 server on a free local port; yields its endpoint URL and its process (a
    test may stop it: a store that stops answering)."""
    pytest.importorskip("moto.server", reason="the dev extra installs moto[server]")
    port = free_port()
    env = {**os.environ, **(extra_env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            assert proc.poll() is None, "moto's server exited at start"
            assert time.monotonic() < deadline, "moto's server did not start in 60 s"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGCONT)  # a stopped server would not see the termination
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def silent_server() -> Iterator[tuple[str, threading.Event]]:
    """An endpoint on 127.0.0.1 that accepts connections and never answers (a store that
    hangs); yields its URL and an event set once it has accepted a connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    accepted, stop = threading.Event(), threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])
                accepted.set()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        server.join()
        for conn in [*held, listener]:
            conn.close()


def s3(endpoint: str):
    """An s3fs file system on ``endpoint`` (no listing cache), for the tests' own reads."""
    import s3fs

    return s3fs.S3FileSystem(
        endpoint_url=endpoint,
        key=ENV["AWS_ACCESS_KEY_ID"],
        secret=ENV["AWS_SECRET_ACCESS_KEY"],
        use_listings_cache=False,
        skip_instance_cache=True,
    )


def new_bucket(endpoint: str) -> str:
    name = f"forge-{uuid.uuid4().hex[:12]}"
    s3(endpoint).mkdir(name)
    return name


@contextlib.contextmanager
def guarded_store() -> Iterator[dict[str, str]]:
    """A moto server that checks credentials (IAM): one bucket, and a user who may only read
    it. Yields the endpoint, the bucket and that user's key and secret."""
    import json

    import boto3

    admin_actions = 4  # the requests below; every later one must carry valid credentials
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": str(admin_actions)}) as endpoint:
        kw = {"endpoint_url": endpoint, "region_name": ENV["AWS_DEFAULT_REGION"]}
        kw |= {"aws_access_key_id": "admin", "aws_secret_access_key": "admin"}
        bucket = "forge-guarded"
        boto3.client("s3", **kw).create_bucket(Bucket=bucket)
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        # every read, head and list action: moto 5.2.6 checks ListObjectsV2 and HeadObject as
        # s3:ListObjectsV2 and s3:HeadObject (AWS and moto 5.2.5: s3:ListBucket, s3:GetObject)
        reads = ["s3:Get*", "s3:Head*", "s3:List*"]
        read_only = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": reads, "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(read_only)
        )
        yield {
            "endpoint": endpoint,
            "bucket": bucket,
            "key": key["AccessKeyId"],
            "secret": key["SecretAccessKey"],
        }
