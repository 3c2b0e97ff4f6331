"""The object store port: objects by '/'-separated key (S3 semantics), written whole, read
whole or as a stream (``open``: a multi-GB object read front to back, never held whole).

``list`` and ``delete_prefix`` match keys by plain string prefix, as S3 does, so
``delete_prefix("runs/r/v1")`` also deletes ``runs/r/v10/...``: end a folder's prefix with '/'.
``upload_dir`` and ``download_dir`` treat the prefix as a folder.

Adapters: ``LocalObjectStore`` (a directory) and ``services.ports.objects.s3_object_store.S3ObjectStore``
(S3 or an S3-compatible store); both pass the same contract tests
(tests/services/ports/objects/test_object_store_contract.py), S3 against a real moto server.
``upload_dir`` returns only once every file is stored, so a marker written after it (a version's
``result.json``) never points at half a version.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol


class ObjectNotFoundError(KeyError):
    """No object has the key (or, for ``download_dir``, no object is under the prefix)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key

    def __str__(self) -> str:
        # KeyError's own str() would show the message in quotes.
        return str(self.args[0])


class ObjectReader(Protocol):
    """An object being read (``ObjectStore.open``): ``read(n)`` gives its next n bytes at most,
    ``readinto(buffer)`` fills buffer likewise; both give b""/0 at its end."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: Any, /) -> int: ...


class ObjectStore(Protocol):
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key``; readers see the old object or the whole new one, never a part."""
        ...

    def put_file(self, key: str, path: Path) -> None:
        """Store the file at ``path`` as ``key``, read in parts, never held whole; readers see the
        old object or the whole new one."""
        ...

    def get_bytes(self, key: str) -> bytes:
        """The object at ``key``; ObjectNotFoundError if there is none."""
        ...

    def open(self, key: str) -> AbstractContextManager[ObjectReader]:
        """The object at ``key`` to read front to back, as a file opened "rb" is read, in parts
        of the caller's size; ObjectNotFoundError if there is none. Use it in a ``with`` block."""
        ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """Sorted keys starting with ``prefix`` ("" lists everything)."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with ``prefix``, which must not be empty."""
        ...

    def upload_dir(self, local_dir: Path, prefix: str) -> None:
        """Store every file under ``local_dir`` at ``<prefix>/<its relative path>``."""
        ...

    def download_dir(self, prefix: str, local_dir: Path) -> None:
        """Write every object under the folder ``prefix`` to ``local_dir/<key relative to prefix>``.

        ObjectNotFoundError if the folder holds no object.
        """
        ...


def folder_key(prefix: str, relative: str) -> str:
    """The key of ``relative`` inside the folder ``prefix`` ("a" and "a/" are the same folder)."""
    return f"{prefix.rstrip('/')}/{relative}" if prefix else relative


# The local adapter writes objects here first, then renames them into place: never a key.
STAGING = ".staging"


def check_key(key: str, *, what: str = "object key") -> None:
    """ValueError unless ``key`` is a key every adapter stores alike (no empty, '.' or '..' part)."""
    parts = key.split("/")
    if not key or "\0" in key or parts[0] == STAGING or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"invalid {what} {key!r}: use a relative, '/'-separated name without empty, '.' or '..'"
            f" parts (and not under {STAGING}/)"
        )


def check_prefix(prefix: str) -> None:
    """ValueError unless ``prefix`` is empty or a valid key (a trailing '/' allowed)."""
    if prefix:
        check_key(prefix.removesuffix("/"), what="prefix")
