"""The object store on S3 or an S3-compatible service (boto3): ``s3://bucket/prefix``.

Settings are AWS's own, read by botocore from the environment (or the shared config files, or
an IAM role): ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``), the region
from ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, and for an S3-compatible service its endpoint,
``AWS_ENDPOINT_URL_S3`` (or ``AWS_ENDPOINT_URL`` for every service; botocore >= 1.31). With an
endpoint set, requests use path-style addressing (``http://host/bucket/key``), which
S3-compatible services accept without per-bucket DNS names. ``AWS_MAX_ATTEMPTS`` and
``AWS_RETRY_MODE`` override the retry settings below; a service that refuses the newer
default checksums takes ``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``.

- Every request is retried with exponential backoff and jitter (botocore's ``standard`` mode:
  connection errors, timeouts, throttling and 5xx answers), ``MAX_ATTEMPTS`` attempts in all.
- Files of ``MULTIPART_THRESHOLD`` bytes or more go up in parts, several at once; an upload
  that fails is aborted, and S3 shows no object until its last part is in, so a reader sees
  the old object or the whole new one (a bucket lifecycle rule ``AbortIncompleteMultipartUpload``
  reclaims the parts of an abort that could not reach the service either).
- ``upload_dir`` returns only once every file is stored, and raises if any could not be: a
  caller that writes its completion marker after it (a policy version's ``result.json``,
  ``services.domain.names.result_key``) never marks a partial folder complete.
- ``list`` pages through ``list_objects_v2``; ``delete_prefix`` deletes a page of up to 1000
  keys per ``DeleteObjects`` request (that request's limit).
- ``open`` reads an object as one GET's body, in the caller's parts (``get_bytes`` reads it
  whole the same way); a body cut off midway is read on from where it stopped
  (``services.ports.objects.s3_reader``).

Errors say what failed and what to do, and never carry a secret key or session token (nor do
botocore's debug log lines, which would: the ``botocore`` logger is kept at INFO): an
answer of the service, or of a connection that failed after its retries, becomes
``ObjectStoreConfigError`` (a permanent ``PermanentError``: credentials, permissions, no such
bucket) or ``ObjectStoreUnavailableError`` (a ``TemporaryError``); a missing key is
``ObjectNotFoundError`` as in every adapter (``services.ports.objects.s3_errors``).
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn, TypeVar
from urllib.parse import urlsplit

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from s3transfer.exceptions import RetriesExceededError

from services.ports.objects.object_store import (
    ObjectNotFoundError,
    check_key,
    check_prefix,
    folder_key,
)
from services.ports.objects.s3_errors import (
    ObjectStoreConfigError,
    ObjectStoreUnavailableError,
    s3_error,
    scrub,
)
from services.ports.objects.s3_reader import S3Reader

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# botocore's debug lines quote each request's headers and canonical form, the session token
# among them: its loggers stay at INFO or above even when the process logs at DEBUG, unless a
# level was set on the "botocore" logger on purpose.
if logging.getLogger("botocore").level == logging.NOTSET:
    logging.getLogger("botocore").setLevel(logging.INFO)

MiB = 1 << 20
# Files this large or larger are uploaded (and downloaded) in parts of MULTIPART_CHUNKSIZE,
# MAX_CONCURRENCY at once: a multi-GB safetensors file goes up at several connections' speed,
# and a failed part is retried alone. S3's smallest part is 5 MiB, its most parts 10,000.
MULTIPART_THRESHOLD = 64 * MiB
MULTIPART_CHUNKSIZE = 64 * MiB
MAX_CONCURRENCY = 8
# Attempts per request, the first included, with exponential backoff (capped at 20 s) between them.
MAX_ATTEMPTS = 10
RETRY_MODE = "standard"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# DeleteObjects takes at most this many keys per request.
DELETE_BATCH = 1000
# Whole-file attempts when an upload's multipart session vanished under it ("NoSuchUpload": a
# retried CompleteMultipartUpload whose first try had completed it, or a lifecycle abort).
_UPLOAD_ATTEMPTS = 3

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class S3ObjectStore:
    """Objects under ``s3://<bucket>/<prefix>``: key ``a/b`` is the S3 object ``<prefix>a/b``.

    Unlike the local adapter, ``a`` and ``a/b`` can both be objects. Keys ending in '/' (the
    empty "folder" objects some consoles create) are not objects here: ``list`` skips them.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str | None = None,
        max_attempts: int | None = None,
        retry_mode: str | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        multipart_chunksize: int = MULTIPART_CHUNKSIZE,
        max_concurrency: int = MAX_CONCURRENCY,
    ) -> None:
        """``endpoint_url``, ``region``, ``max_attempts`` and ``retry_mode`` default to the AWS
        environment settings (module docstring), then to this module's constants;
        ``addressing_style`` ("path", "virtual" or "auto") to "path" when an endpoint is set."""
        if not _BUCKET_NAME.match(bucket):
            raise ValueError(f"invalid S3 bucket name {bucket!r}: 3-63 lowercase letters, digits, '.' and '-'")
        check_prefix(prefix)
        self.bucket = bucket
        self.root = folder_key(prefix, "") if prefix else ""  # "" or "a/b/"
        if addressing_style is None and _endpoint_in_use(endpoint_url):
            addressing_style = "path"
        self.max_attempts = max_attempts or _env_int("AWS_MAX_ATTEMPTS") or MAX_ATTEMPTS
        config = Config(
            retries={
                "mode": retry_mode or os.environ.get("AWS_RETRY_MODE") or RETRY_MODE,
                "total_max_attempts": self.max_attempts,
            },
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            s3={"addressing_style": addressing_style} if addressing_style else None,
            # One pooled connection per concurrent part, and a few for the other requests.
            max_pool_connections=max_concurrency + 4,
        )
        try:
            self._client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url or None,  # None: botocore reads AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
                region_name=region or os.environ.get("AWS_REGION") or None,  # botocore reads AWS_DEFAULT_REGION
                config=config,
            )
        except (ValueError, BotoCoreError) as err:
            raise ObjectStoreConfigError(
                f"cannot open the S3 store s3://{bucket}/{self.root}: {scrub(str(err))}. Check AWS_REGION and"
                " AWS_ENDPOINT_URL_S3"
            ) from None
        self.endpoint = self._client.meta.endpoint_url
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            # The client's own retries cover each request; these cover a download stream cut midway.
            num_download_attempts=self.max_attempts,
            preferred_transfer_client="classic",
        )

    @classmethod
    def from_url(cls, url: str, **options: object) -> S3ObjectStore:
        """The store of ``s3://bucket[/prefix]``; ``options`` as the constructor's."""
        parts = urlsplit(url)
        if parts.scheme != "s3":
            raise ValueError("an S3 object store URL starts with s3:// (s3://bucket/prefix)")
        if "@" in parts.netloc:
            # Not echoed: what comes before '@' may be a secret.
            raise ValueError(
                "an s3:// URL must not carry credentials: give them as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                " (or an IAM role), and the URL as s3://bucket/prefix"
            )
        # The URL is not echoed below either: a query may hold a secret too.
        if parts.query or parts.fragment or parts.port is not None:
            raise ValueError(
                "an s3:// URL is s3://bucket/prefix, without a port, query or fragment; give an"
                " S3-compatible service's endpoint as AWS_ENDPOINT_URL_S3"
            )
        if not parts.hostname:
            raise ValueError("the s3:// URL names no bucket: use s3://bucket/prefix")
        return cls(parts.netloc, parts.path.strip("/"), **options)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"S3ObjectStore('s3://{self.bucket}/{self.root}', endpoint={self.endpoint!r})"

    # --- the port -------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> None:
        name = self._name(key)
        if len(data) >= self._transfer.multipart_threshold:
            self._upload(io.BytesIO(data), name, key)
        else:
            self._call("PutObject", key, lambda: self._client.put_object(Bucket=self.bucket, Key=name, Body=data))

    def put_file(self, key: str, path: Path) -> None:
        # From the file, in parts once it is MULTIPART_THRESHOLD or larger, each read when it is sent.
        self._upload(str(path), self._name(key), key)

    def get_bytes(self, key: str) -> bytes:
        with self.open(key) as body:
            return body.read()

    def open(self, key: str) -> S3Reader:
        name = self._name(key)
        return S3Reader(
            lambda **extra: self._client.get_object(Bucket=self.bucket, Key=name, **extra),
            lambda request: self._call("GetObject", key, request),
            attempts=self.max_attempts,
            name=f"s3://{self.bucket}/{name}",
        )

    def exists(self, key: str) -> bool:
        name = self._name(key)
        try:
            self._call("HeadObject", key, lambda: self._client.head_object(Bucket=self.bucket, Key=name))
        except ObjectNotFoundError:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        check_prefix(prefix)
        return sorted(name[len(self.root) :] for name in self._names(prefix) if not name.endswith("/"))

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("refusing to delete every object: pass a non-empty prefix")
        check_prefix(prefix)
        # A page of a listing holds at most 1000 keys, a DeleteObjects request takes as many.
        for page in self._pages(prefix):
            for start in range(0, len(page), DELETE_BATCH):
                self._delete(page[start : start + DELETE_BATCH], prefix)

    def upload_dir(self, local_dir: Path, prefix: str) -> None:
        if not local_dir.is_dir():
            raise NotADirectoryError(f"cannot upload {local_dir}: it is not a directory")
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        keys = [folder_key(prefix, path.relative_to(local_dir).as_posix()) for path in files]
        for key in keys:
            check_key(key)
        # All files at once (each in parts if large), and back only once every one is stored:
        # the first failure cancels the rest and is raised.
        with create_transfer_manager(self._client, self._transfer) as manager:
            futures = [
                manager.upload(str(path), self.bucket, self._name(key)) for path, key in zip(files, keys, strict=True)
            ]
            for path, key, future in zip(files, keys, futures, strict=True):
                try:
                    self._call("PutObject", key, future.result)
                except ObjectStoreUnavailableError as err:
                    if err.code != "NoSuchUpload":
                        raise
                    self._upload(str(path), self._name(key), key)  # again, whole

    def download_dir(self, prefix: str, local_dir: Path) -> None:
        folder = folder_key(prefix, "")
        keys = self.list(folder)
        if not keys:
            raise ObjectNotFoundError(f"no objects under {folder!r} in s3://{self.bucket}/{self.root}", folder)
        targets = [local_dir / key[len(folder) :] for key in keys]
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
        with create_transfer_manager(self._client, self._transfer) as manager:
            futures = [
                (key, manager.download(self.bucket, self._name(key), str(target)))
                for key, target in zip(keys, targets, strict=True)
            ]
            for key, future in futures:
                try:
                    self._call("GetObject", key, future.result)
                except ObjectNotFoundError:
                    raise ObjectNotFoundError(f"object {key!r} was deleted during the download", key) from None

    # --- helpers --------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        """The S3 key of ``key``."""
        check_key(key)
        return self.root + key

    def _pages(self, prefix: str) -> Iterator[list[str]]:
        """The S3 keys starting with ``prefix``, a listing page (at most 1000) at a time."""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = iter(paginator.paginate(Bucket=self.bucket, Prefix=self.root + prefix))
        while True:
            page = self._call("ListObjectsV2", prefix, lambda: next(pages, None))
            if page is None:
                return
            yield [obj["Key"] for obj in page.get("Contents", [])]

    def _names(self, prefix: str) -> list[str]:
        return [name for page in self._pages(prefix) for name in page]

    def _delete(self, names: list[str], prefix: str) -> None:
        if not names:
            return
        answer = self._call(
            "DeleteObjects",
            prefix,
            lambda: self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": n} for n in names], "Quiet": True}
            ),
        )
        if errors := answer.get("Errors"):
            first = errors[0]
            err = ClientError(
                {"Error": {"Code": first.get("Code", ""), "Message": first.get("Message", "")}}, "DeleteObjects"
            )
            self._raise(
                "DeleteObjects",
                first.get("Key", prefix).removeprefix(self.root),
                err,
                note=f"{len(errors)} of {len(names)} keys were not deleted",
            )

    def _upload(self, source: str | io.BytesIO, name: str, key: str) -> None:
        """One object through the transfer manager (in parts if large), whole again when its
        multipart session vanished."""
        for attempt in range(1, _UPLOAD_ATTEMPTS + 1):
            if isinstance(source, io.BytesIO):
                source.seek(0)
            with create_transfer_manager(self._client, self._transfer) as manager:
                future = manager.upload(source, self.bucket, name)
                try:
                    self._call("PutObject", key, future.result)
                    return
                except ObjectStoreUnavailableError as err:
                    if err.code != "NoSuchUpload" or attempt == _UPLOAD_ATTEMPTS:
                        raise
            log.warning(
                "the multipart upload of s3://%s/%s vanished (NoSuchUpload); uploading it again", self.bucket, name
            )

    def _call(self, operation: str, key: str, request: Callable[[], _T]) -> _T:
        """``request()``, its failures turned into this port's errors."""
        try:
            return request()
        except (ClientError, BotoCoreError, RetriesExceededError) as err:
            self._raise(operation, key, err)

    def _raise(self, operation: str, key: str, err: Exception, note: str = "") -> NoReturn:
        """Raise this port's error for ``err`` (``s3_error``), self-contained: the client's exception
        is not chained on, since what it quotes is not ours to vet (what S3 said is, scrubbed)."""
        where = f"s3://{self.bucket}/{self.root}"
        raise s3_error(
            err,
            operation=f"{operation} {where}{key} (endpoint {self.endpoint})",
            key=key,
            where=where,
            bucket=self.bucket,
            attempts=self.max_attempts,
            note=note,
        ) from None


def _endpoint_in_use(endpoint_url: str | None) -> str | None:
    """``endpoint_url``, else the environment's S3 endpoint, else None (AWS's); refused if it
    carries credentials."""
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if "@" in urlsplit(endpoint or "").netloc:
        # Not echoed: what comes before '@' may be a secret; botocore would quote it in its errors.
        raise ValueError(
            "the S3 endpoint URL must not carry credentials (user:password@): give them as AWS_ACCESS_KEY_ID"
            " and AWS_SECRET_ACCESS_KEY, and the endpoint as http(s)://host:port"
        )
    return endpoint


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None
