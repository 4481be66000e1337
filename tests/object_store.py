"""A real S3-compatible endpoint for the tests: moto's server, started on 127.0.0.1 by the
first test that needs it (once per worker) and stopped at the end of the session. The
tests drive it through s3fs, exactly as AWS would be driven: endpoint and credentials in the
standard AWS variables."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
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
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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
