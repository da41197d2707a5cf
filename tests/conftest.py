"""Shared test fixtures: a real moto S3 server over HTTP, fresh buckets, and IAM-enforced auth.

The moto server runs as a separate process (``python -m moto.server``) on 127.0.0.1 with a free
port; nothing is mocked inside the test process. Fake AWS credentials and ``AWS_ENDPOINT_URL`` are
set only while the session fixture is active (and are inherited by subprocesses and by Ray
clusters started afterwards), then restored.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The release-checkpoint modules ask for it with pytest.mark.usefixtures("single_thread"), which an
# import inside each module cannot keep (a linter sees it unused).
from tests.checkpoint_fixtures import single_thread  # noqa: F401


def pytest_configure(config: pytest.Config) -> None:
    # In a new environment the CPU kernels compile on first use (~45 s, a compiler on the other core):
    # start that while pytest collects, rather than in the first test that needs them. Callers of
    # cpu_kernels.extension() wait for this build; a build that fails logs why, as it would there.
    from specray.models import cpu_kernels

    if cpu_kernels.ENABLED:
        threading.Thread(target=cpu_kernels.extension, name="cpu-kernels-build", daemon=True).start()


FAKE_ACCESS_KEY = "testing"
FAKE_SECRET_KEY = "testing"
MOTO_REGION = "us-east-1"
MOTO_START_TIMEOUT_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait_until_serving(url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + MOTO_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with {process.returncode}; log:\n{log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server did not answer at {url} within {MOTO_START_TIMEOUT_S} s")


def moto_set_auth_action_count(endpoint: str, count: float) -> float:
    """Moto's server-mode switch: after ``count`` more requests, every request is IAM-authenticated.

    0 enforces auth now; ``float('inf')`` (moto's default) accepts any credentials. Returns the
    previous value.
    """
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=str(count).encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},  # a form content-type would hide the body from moto
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return float(json.loads(response.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL (``http://127.0.0.1:PORT``) of a moto server process serving S3 (and IAM, STS)."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "inf"},
        )
    try:
        _wait_until_serving(f"{endpoint}/moto-api/", process, log_path)
        with pytest.MonkeyPatch.context() as env:
            for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                         "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_IAM", "AWS_ENDPOINT_URL_STS"):
                env.delenv(name, raising=False)
            env.setenv("AWS_ACCESS_KEY_ID", FAKE_ACCESS_KEY)
            env.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET_KEY)
            env.setenv("AWS_DEFAULT_REGION", MOTO_REGION)
            env.setenv("AWS_REGION", MOTO_REGION)
            env.setenv("AWS_ENDPOINT_URL", endpoint)
            # Never read a developer's real ~/.aws files or query instance metadata.
            missing = str(log_path.parent / "no-such-aws-file")
            env.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
            env.setenv("AWS_CONFIG_FILE", missing)
            env.setenv("AWS_EC2_METADATA_DISABLED", "true")
            yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def boto3_client(endpoint: str, service: str = "s3", **credentials: str):
    """A boto3 client bound to the moto endpoint (credentials default to the environment's)."""
    import boto3

    return boto3.client(service, endpoint_url=endpoint, region_name=MOTO_REGION, **credentials)


@pytest.fixture
def s3_bucket(moto_server: str) -> Iterator[str]:
    """A fresh, empty bucket on the moto server, as ``s3://<bucket>``."""
    name = f"specray-test-{uuid.uuid4().hex[:16]}"
    client = boto3_client(moto_server)
    client.create_bucket(Bucket=name)
    yield f"s3://{name}"
    try:  # best effort: the server is discarded at the end of the session anyway
        for upload in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
            client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for item in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=item["Key"])
        client.delete_bucket(Bucket=name)
    except Exception:  # noqa: BLE001
        pass


@dataclass(frozen=True)
class AwsKeys:
    access_key_id: str
    secret_access_key: str

    def storage_options(self, endpoint: str) -> dict[str, object]:
        """s3fs storage_options using these keys explicitly."""
        return {"key": self.access_key_id, "secret": self.secret_access_key, "endpoint_url": endpoint}


@dataclass(frozen=True)
class MotoAuth:
    endpoint: str
    allowed: AwsKeys  # IAM user with an s3:* allow policy
    denied: AwsKeys  # IAM user with no policy: authenticated, but every S3 action is denied


@pytest.fixture
def moto_auth(moto_server: str) -> Iterator[MotoAuth]:
    """Make the moto server enforce IAM authentication/authorisation for this test only.

    Creates two IAM users first (while auth is still open), then switches moto to checking every
    request's signature and IAM policy; the fake session credentials are then unknown keys
    (InvalidAccessKeyId). The previous mode is restored afterwards.
    """
    iam = boto3_client(moto_server, "iam")
    suffix = uuid.uuid4().hex[:8]
    keys: dict[str, AwsKeys] = {}
    for role in ("allowed", "denied"):
        user = f"specray-{role}-{suffix}"
        iam.create_user(UserName=user)
        created = iam.create_access_key(UserName=user)["AccessKey"]
        keys[role] = AwsKeys(created["AccessKeyId"], created["SecretAccessKey"])
        if role == "allowed":
            policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
            iam.put_user_policy(UserName=user, PolicyName="s3-all", PolicyDocument=json.dumps(policy))
    previous = moto_set_auth_action_count(moto_server, 0)
    try:
        yield MotoAuth(endpoint=moto_server, allowed=keys["allowed"], denied=keys["denied"])
    finally:
        moto_set_auth_action_count(moto_server, previous)
