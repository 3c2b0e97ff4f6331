"""A real S3 server for the S3 adapter's tests: moto's server mode, one per session.

``moto[server]`` (PyPI, in the ``test`` extra) answers S3's HTTP API as S3 does (multipart
uploads, listing pages, batch deletes, ``NoSuchKey``/``NoSuchBucket``, ``EntityTooSmall``). It
runs as its own process (``python -m moto.server``) on a free loopback port, started on first
use, so a session that runs no S3 test starts nothing; being a process, it can be made
unreachable for a while (``paused()``: SIGSTOP, then SIGCONT) the way a hung or partitioned
service looks. It keeps its objects in memory and is stopped by its PID when the session ends.

Fixtures:
- ``s3_server``: the session's server (``S3Server``: ``endpoint_url``, ``pid``, ``client()``,
  ``paused()``, and ``checking_credentials()`` with ``iam_user()``: S3's authentication and
  IAM permissions, which the server otherwise skips).
- ``s3_bucket``: a fresh, empty bucket for one test (``S3Bucket``: ``name``, ``url`` of
  ``s3://<bucket>/spotrl`` for ``S3ObjectStore.from_url``, ``secret_key``), with the AWS
  settings of the environment pointing at the server: ``AWS_ENDPOINT_URL_S3``, a region, and
  test credentials whose secret key is a distinct random string, so a test can check that no
  message ever shows it. Nothing else of the machine's AWS setup (profiles, ~/.aws) applies.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from tests.servers.process import end, free_port, paused, wait_until_it_answers

REGION = "us-east-1"
ACCESS_KEY_ID = "AKIASPOTRLTESTKEY"


class S3Server:
    """One moto server process on 127.0.0.1, stopped by its PID."""

    def __init__(self) -> None:
        self._log = Path(tempfile.mkstemp(prefix="spotrl-moto-", suffix=".log")[1])
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.pid = self._proc.pid
        client = self.client()
        wait_until_it_answers(
            self._proc, "moto server", lambda: bool(client.list_buckets()), self._log, timeout_s=60.0, every_s=0.1
        )

    def client(self) -> Any:  # a botocore S3 client (its class is made at run time)
        """A plain boto3 client for the test's own setup and checks (its own retries off)."""
        return boto3.session.Session(
            aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key="admin-secret", region_name=REGION
        ).client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(
                s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}, connect_timeout=5, read_timeout=30
            ),
        )

    def iam_user(self, name: str, allow: list[str]) -> tuple[str, str]:
        """A new IAM user of the server, allowed the S3 actions ``allow`` on every resource: its
        access key id and secret (made while the server checks no credentials)."""
        iam = boto3.session.Session(
            aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key="admin-secret", region_name=REGION
        ).client("iam", endpoint_url=self.endpoint_url)
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": allow, "Resource": "*"}]}
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    @contextlib.contextmanager
    def checking_credentials(self) -> Iterator[None]:
        """While the block runs, the server checks every request as S3 does: its signature against
        the IAM users' access keys (``InvalidAccessKeyId``, ``SignatureDoesNotMatch``), then the
        user's policies (``AccessDenied``). moto's IAM authentication, switched on and off through
        its ``/moto-api/reset-auth`` (the number of requests let through unchecked)."""
        self._unchecked_requests("0")
        try:
            yield
        finally:
            self._unchecked_requests("inf")

    def _unchecked_requests(self, count: str) -> None:
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )  # as a form, moto reads no body
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """S3 unreachable for a while: the process is stopped (SIGSTOP), so connections are
        accepted by the kernel but nothing answers; SIGCONT at the end, and the server carries
        on with its objects (and answers the requests that waited meanwhile)."""
        return paused(self.pid)

    def stop(self) -> None:
        end(self._proc)
        self._log.unlink(missing_ok=True)


@dataclass(frozen=True)
class S3Bucket:
    server: S3Server
    name: str
    secret_key: str  # AWS_SECRET_ACCESS_KEY while the test runs
    session_token: str  # AWS_SESSION_TOKEN likewise

    @property
    def url(self) -> str:
        return f"s3://{self.name}/spotrl"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[S3Bucket]:
    """A fresh bucket on the session's server, and the environment a production pod would have."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    secret, token = "s3cr3t-" + secrets.token_hex(16), "t0ken-" + secrets.token_hex(16)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket = S3Bucket(
        server=s3_server, name=f"spotrl-test-{secrets.token_hex(6)}", secret_key=secret, session_token=token
    )
    client = s3_server.client()
    client.create_bucket(Bucket=bucket.name)
    yield bucket
    # Emptied and removed, so a long session keeps little in the server's memory.
    with contextlib.suppress(Exception):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket.name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket.name, Delete={"Objects": keys, "Quiet": True})
        for upload in client.list_multipart_uploads(Bucket=bucket.name).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket.name, Key=upload["Key"], UploadId=upload["UploadId"])
        client.delete_bucket(Bucket=bucket.name)
