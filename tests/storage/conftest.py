"""An S3-compatible server for the object store's tests: moto's, run as a process of its own
on a free port (the store speaks real HTTP to it, as to S3), for the whole session. The
standard AWS variables point every S3 client of this process at it, as an operator's would.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from ballast import procs


@pytest.fixture(scope="session")
def s3_endpoint():
    port = procs.free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = pytest.MonkeyPatch()
    try:
        deadline = time.monotonic() + 60
        while not procs.port_open(port):
            assert server.poll() is None, f"moto's server exited ({server.returncode})"
            assert time.monotonic() < deadline, "moto's server did not listen within 60 s"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        env.setenv("AWS_ENDPOINT_URL_S3", url)
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.delenv("AWS_SESSION_TOKEN", raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        yield url
    finally:
        env.undo()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def s3(s3_endpoint):
    """boto3's client of the server: the outside oracle, which Ballast's code does not use."""
    import boto3  # type: ignore[import-untyped]

    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture
def bucket(s3) -> str:
    """A new, empty bucket."""
    name = f"ballast-test-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def keys_in(s3, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))
