"""What the S3 adapter does beyond the port's contract (test_object_store_contract.py runs that
against the same server): multipart uploads, listing and deleting past one page, publishing
while S3 is unreachable, settings from the environment, and errors that name what to do and
never a secret. Against moto's S3 server (tests/servers/s3.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from botocore.stub import Stubber

from services.core.errors import PermanentError, TemporaryError
from services.domain.names import policy_prefix, result_key
from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.objects.object_store import ObjectNotFoundError, ObjectStore
from services.ports.objects.s3_errors import ObjectStoreConfigError, ObjectStoreUnavailableError
from services.ports.objects.s3_object_store import S3ObjectStore
from services.ports.wiring import open_object_store
from tests.servers.process import half_closed
from tests.servers.s3 import S3Bucket

MiB = 1 << 20
ROOT = "spotrl/"  # the prefix of S3Bucket.url


def _etag(bucket: S3Bucket, key: str) -> str:
    return bucket.server.client().head_object(Bucket=bucket.name, Key=ROOT + key)["ETag"].strip('"')


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _policy_dir(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A policy version's folder with one file above a 5 MiB multipart threshold (3 parts)."""
    source = tmp_path / "v1"
    (source / "tokenizer").mkdir(parents=True)
    files = {"model.safetensors": os.urandom(11 * MiB), "config.json": b'{"a": 1}', "tokenizer/t.json": b"t" * 5000}
    for relative, data in files.items():
        (source / relative).write_bytes(data)
    return source, files


def _publish(store: ObjectStore, source: Path, run_id: str = "r", version: int = 1) -> None:
    """As the training job publishes: the files, then the marker."""
    store.upload_dir(source, policy_prefix(run_id, version))
    store.put_bytes(result_key(run_id, version), b"{}")


def _small_parts(bucket: S3Bucket, **options: object) -> S3ObjectStore:
    return S3ObjectStore.from_url(bucket.url, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, **options)


def _count(store: S3ObjectStore, event: str) -> list[dict]:
    """The parameters of each request the store's client makes for ``event`` (e.g. "s3.ListObjectsV2")."""
    seen: list[dict] = []
    store._client.meta.events.register(f"before-parameter-build.{event}", lambda params, **_: seen.append(dict(params)))
    return seen


# --- multipart ----------------------------------------------------------------------------
def test_a_file_above_the_threshold_goes_up_in_parts(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = _small_parts(s3_bucket)
    source, files = _policy_dir(tmp_path)
    parts = _count(store, "s3.UploadPart")
    store.upload_dir(source, "runs/r/policy/v1/")

    # S3's ETag of a multipart object is "<md5 of the parts' md5s>-<number of parts>".
    assert _etag(s3_bucket, "runs/r/policy/v1/model.safetensors").endswith("-3")
    assert len(parts) == 3
    assert "-" not in _etag(s3_bucket, "runs/r/policy/v1/config.json")
    store.download_dir("runs/r/policy/v1/", tmp_path / "back")
    assert _tree(tmp_path / "back") == files

    big = os.urandom(6 * MiB)
    store.put_bytes("runs/r/blob", big)  # put_bytes too, above the threshold
    assert _etag(s3_bucket, "runs/r/blob").endswith("-2")
    assert store.get_bytes("runs/r/blob") == big


def test_a_file_below_the_threshold_goes_up_whole(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = S3ObjectStore.from_url(s3_bucket.url)  # the default threshold, 64 MiB
    source, files = _policy_dir(tmp_path)
    store.upload_dir(source, "runs/r/policy/v1/")
    assert "-" not in _etag(s3_bucket, "runs/r/policy/v1/model.safetensors")


# --- pages --------------------------------------------------------------------------------
def test_listing_and_deleting_go_past_one_page_of_1000_keys(s3_bucket: S3Bucket) -> None:
    keys = [f"runs/r/many/{i:05d}" for i in range(2100)]
    admin = s3_bucket.server.client()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: admin.put_object(Bucket=s3_bucket.name, Key=ROOT + k, Body=b"x"), keys))
    admin.put_object(Bucket=s3_bucket.name, Key=ROOT + "runs/r/other", Body=b"kept")
    store = S3ObjectStore.from_url(s3_bucket.url)

    pages = _count(store, "s3.ListObjectsV2")
    assert store.list("runs/r/many/") == keys
    assert len(pages) == 3  # 1000 + 1000 + 100

    deletes = _count(store, "s3.DeleteObjects")
    store.delete_prefix("runs/r/many/")
    assert [len(d["Delete"]["Objects"]) for d in deletes] == [1000, 1000, 100]
    assert store.list("runs/r/") == ["runs/r/other"]


# --- S3 unreachable while publishing ------------------------------------------------------
@pytest.fixture
def unreachable_for(s3_bucket: S3Bucket) -> Iterator[Callable[[float], threading.Event]]:
    """``unreachable_for(seconds)`` stops the server now and starts it again ``seconds`` later,
    from another thread; the event is set once it answers again."""
    threads: list[threading.Thread] = []

    def pause(seconds: float) -> threading.Event:
        paused, resumed = threading.Event(), threading.Event()

        def run() -> None:
            with s3_bucket.server.paused():
                paused.set()
                time.sleep(seconds)
            resumed.set()

        threads.append(threading.Thread(target=run))
        threads[-1].start()
        paused.wait()
        return resumed

    yield pause
    for thread in threads:
        thread.join()


def test_publishing_rides_out_a_few_seconds_of_s3_unreachable(
    s3_bucket: S3Bucket, tmp_path: Path, unreachable_for: Callable[[float], threading.Event]
) -> None:
    store = _small_parts(s3_bucket, connect_timeout_s=1.0, read_timeout_s=1.0, max_attempts=20)
    source, files = _policy_dir(tmp_path)
    retried: list[str] = []  # the errors of the attempts that were retried

    def note(caught_exception: Exception | None = None, **_: object) -> None:
        if caught_exception is not None:
            retried.append(repr(caught_exception))

    store._client.meta.events.register("needs-retry.s3", note)
    resumed = unreachable_for(4.0)
    _publish(store, source)

    assert resumed.is_set()  # it finished only once S3 answered again
    assert retried, "no request was retried"
    assert store.exists(result_key("r", 1))
    store.download_dir(policy_prefix("r", 1), tmp_path / "back")
    assert _tree(tmp_path / "back") == files


def test_publishing_fails_cleanly_when_s3_stays_unreachable(
    s3_bucket: S3Bucket, tmp_path: Path, unreachable_for: Callable[[float], threading.Event], wait_for
) -> None:
    store = _small_parts(s3_bucket, connect_timeout_s=1.0, read_timeout_s=1.0, max_attempts=2)
    source, files = _policy_dir(tmp_path)
    asked: list[str] = []  # the key of every request the store sent
    store._client.meta.events.register(
        "before-parameter-build.s3", lambda params, **_: asked.append(params.get("Key", ""))
    )
    resumed = unreachable_for(8.0)
    with pytest.raises(ObjectStoreUnavailableError) as caught:
        _publish(store, source)
    assert not resumed.is_set()  # it gave up while S3 was still unreachable
    assert isinstance(caught.value, TemporaryError)
    message = str(caught.value)
    assert s3_bucket.server.endpoint_url in message and "2 attempts" in message and "AWS_ENDPOINT_URL_S3" in message
    assert_no_secret(s3_bucket, caught.value)

    # Not published: the marker was never even sent, so no request that waited can land it.
    assert asked and ROOT + result_key("r", 1) not in asked

    resumed.wait()
    store = S3ObjectStore.from_url(s3_bucket.url)
    wait_for(lambda: store.list("") is not None, message="S3 answers again")
    # The requests that waited in the stopped server's socket (their client gave up on them) are
    # answered now: once the server has closed each of those connections, all of them have landed.
    wait_for(lambda: half_closed(s3_bucket.server.port) == 0, timeout_s=60, message="the waiting requests handled")
    # So no reader loads the version; and whatever did land is whole (no object of a multipart
    # upload shows before its last part).
    assert not store.exists(result_key("r", 1))
    for key in store.list(""):
        assert store.get_bytes(key) == files[key.removeprefix(policy_prefix("r", 1))]


# --- settings -----------------------------------------------------------------------------
def test_settings_come_from_the_aws_environment(s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    store = S3ObjectStore.from_url(s3_bucket.url)
    assert store._client.meta.region_name == "eu-west-3"
    assert store._client.meta.endpoint_url == s3_bucket.server.endpoint_url  # AWS_ENDPOINT_URL_S3
    assert store._client.meta.config.retries == {"mode": "standard", "total_max_attempts": 4}
    assert store._client.meta.config.s3 == {"addressing_style": "path"}  # an endpoint is set
    store.put_bytes("a", b"1")
    assert S3ObjectStore.from_url(s3_bucket.url).get_bytes("a") == b"1"

    # An explicit endpoint wins over the environment's; the global AWS_ENDPOINT_URL is read too.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    assert S3ObjectStore.from_url(s3_bucket.url, endpoint_url=s3_bucket.server.endpoint_url).get_bytes("a") == b"1"
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_bucket.server.endpoint_url)
    assert S3ObjectStore.from_url(s3_bucket.url).get_bytes("a") == b"1"


def test_the_url_names_bucket_and_prefix(s3_bucket: S3Bucket) -> None:
    whole = S3ObjectStore.from_url(f"s3://{s3_bucket.name}")
    inner = S3ObjectStore.from_url(f"s3://{s3_bucket.name}/a/b/")
    inner.put_bytes("k", b"v")
    assert whole.list("") == ["a/b/k"]
    assert S3ObjectStore.from_url(f"s3://{s3_bucket.name}/a/b").get_bytes("k") == b"v"
    for bad in ["s3://", "s3:///p", "s3://Bad_Bucket/p", "s3://b/a/../c", "s3://bucket:9000/p", "s3://bucket/p?x=1"]:
        with pytest.raises(ValueError):
            S3ObjectStore.from_url(bad)


def test_open_object_store_chooses_the_adapter_by_scheme(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    assert isinstance(open_object_store(None, tmp_path), LocalObjectStore)
    assert isinstance(open_object_store("", tmp_path), LocalObjectStore)
    store = open_object_store(s3_bucket.url, tmp_path)
    assert isinstance(store, S3ObjectStore) and (store.bucket, store.root) == (s3_bucket.name, ROOT)
    for url in ["gs://bucket-7/p", "file:///tmp/x7", "user:pass7@bucket-7/p"]:
        with pytest.raises(ValueError, match="s3://bucket/prefix") as caught:
            open_object_store(url, tmp_path)
        assert url not in str(caught.value)


# --- errors -------------------------------------------------------------------------------
def assert_no_secret(bucket: S3Bucket, *errors: BaseException, logs: str = "", also: str = "") -> None:
    hidden = [bucket.secret_key, bucket.session_token, *filter(None, [also])]
    for err in errors:
        text = "".join(traceback.format_exception(err))  # the causes included
        assert not [h for h in hidden if h in text], text
    assert not [h for h in hidden if h in logs]


def test_errors_say_what_to_do_and_show_no_secret(
    s3_bucket: S3Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)  # botocore's and s3transfer's debug lines too
    errors: list[BaseException] = []

    missing = S3ObjectStore.from_url(f"s3://spotrl-no-such-bucket-{os.getpid()}/p")
    with pytest.raises(ObjectStoreConfigError, match="does not exist.*Create it") as caught:
        missing.put_bytes("k", b"v")
    assert isinstance(caught.value, PermanentError)
    errors.append(caught.value)

    store = S3ObjectStore.from_url(s3_bucket.url)
    with pytest.raises(ObjectNotFoundError, match="'none'") as not_found:
        store.get_bytes("none")
    errors.append(not_found.value)

    closed = S3ObjectStore.from_url(
        s3_bucket.url, endpoint_url="http://127.0.0.1:9", max_attempts=2, connect_timeout_s=1.0
    )
    with pytest.raises(ObjectStoreUnavailableError, match="127.0.0.1:9.*reachable") as unreachable:
        closed.list("")
    errors.append(unreachable.value)

    # What S3 answers to credentials it does not know, to a missing permission and to a wrong secret,
    # from the server checking them as S3 does: the fixture's key belongs to no IAM user; the
    # writer's may only put.
    writer_key, writer_secret = s3_bucket.server.iam_user(f"writer-{secrets.token_hex(4)}", allow=["s3:PutObject"])
    with s3_bucket.server.checking_credentials():
        with pytest.raises(ObjectStoreConfigError, match="InvalidAccessKeyId.*Check AWS_ACCESS_KEY_ID") as unknown:
            store.get_bytes("k")
        errors.append(unknown.value)
        with monkeypatch.context() as writer_env:  # a process of its own, holding the writer's key
            writer_env.setenv("AWS_ACCESS_KEY_ID", writer_key)
            writer_env.setenv("AWS_SECRET_ACCESS_KEY", writer_secret)
            writer_env.delenv("AWS_SESSION_TOKEN")
            writer = S3ObjectStore.from_url(s3_bucket.url)
            writer.put_bytes("k", b"v")
            with pytest.raises(ObjectStoreConfigError, match="AccessDenied.*s3:GetObject.*s3:ListBucket") as denied:
                writer.get_bytes("k")
        errors.append(denied.value)
        with monkeypatch.context() as rotated_env:  # the writer's key id with a secret that was rotated since
            rotated_env.setenv("AWS_ACCESS_KEY_ID", writer_key)
            rotated_env.setenv("AWS_SECRET_ACCESS_KEY", "old-" + writer_secret)
            rotated_env.delenv("AWS_SESSION_TOKEN")
            with pytest.raises(
                ObjectStoreConfigError, match="refused the credentials .SignatureDoesNotMatch"
            ) as rotated:
                S3ObjectStore.from_url(s3_bucket.url).get_bytes("k")
        errors.append(rotated.value)
    # moto never throttles: S3's 503 SlowDown comes from botocore's Stubber. Its message quotes
    # the secret, which S3 never receives: the scrub is a second line.
    with Stubber(store._client) as stub:
        stub.add_client_error(
            "get_object",
            service_error_code="SlowDown",
            http_status_code=503,
            service_message=f"answer quoting {s3_bucket.secret_key}",
        )
        with pytest.raises(ObjectStoreUnavailableError, match="SlowDown.*retried later") as slow_down:
            store.get_bytes("k")
    errors.append(slow_down.value)

    # Credentials in a URL are refused without being echoed.
    in_endpoint = {"endpoint_url": f"http://u:{s3_bucket.secret_key}@127.0.0.1:9"}
    for url, options in [(f"s3://AKIA:{s3_bucket.secret_key}@{s3_bucket.name}/p", {}), (s3_bucket.url, in_endpoint)]:
        with pytest.raises(ValueError, match="must not carry credentials") as in_url:
            S3ObjectStore.from_url(url, **options)
        errors.append(in_url.value)

    assert_no_secret(s3_bucket, *errors, logs=caplog.text, also=writer_secret)


# --- reading ------------------------------------------------------------------------------
class CuttingProxy:
    """A loopback TCP proxy to the S3 server that cuts its first connection whose answers pass
    ``cut_after`` bytes: a body broken off midway, as a dropped connection leaves it."""

    def __init__(self, upstream_port: int, cut_after: int) -> None:
        self.cut_after, self.cuts = cut_after, 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._upstream_port = upstream_port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            server = socket.create_connection(("127.0.0.1", self._upstream_port))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, answers: bool) -> None:
        sent = 0
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if answers and not self.cuts and sent + len(data) > self.cut_after:
                    self.cuts += 1
                    target.sendall(data[: self.cut_after - sent])
                    break
                target.sendall(data)
                sent += len(data)
        for sock in (source, target):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()


def test_a_body_cut_off_midway_is_read_on_from_where_it_stopped(
    s3_bucket: S3Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    data = secrets.token_bytes(3 * MiB)
    S3ObjectStore.from_url(s3_bucket.url).put_bytes("runs/r/policy/v1/model.safetensors", data)
    proxy = CuttingProxy(s3_bucket.server.port, cut_after=MiB)
    try:
        store = S3ObjectStore.from_url(s3_bucket.url, endpoint_url=proxy.url)
        with caplog.at_level(logging.WARNING), store.open("runs/r/policy/v1/model.safetensors") as stream:
            parts = []
            while part := stream.read(256 * 1024):
                parts.append(part)
    finally:
        proxy.close()
    assert proxy.cuts == 1
    assert b"".join(parts) == data
    assert any("was cut off at byte" in r.getMessage() for r in caplog.records), "it did not read on"
