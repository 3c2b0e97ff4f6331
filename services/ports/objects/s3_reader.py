"""An S3 object read front to back (``S3ObjectStore.open``), in parts of the caller's size.

botocore retries requests, not a body cut off after its answer began: a cut-off body is asked
for again from its first byte not yet read (a ranged GET, with ``If-Match`` the first answer's
ETag, so that the rest comes from the same object or not at all), as many bodies in all as the
store makes attempts. A whole object read this way is checked against the checksum S3 keeps for
it, when it keeps one (botocore's response checksum validation, at the body's end).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from botocore.exceptions import IncompleteReadError, ResponseStreamingError

from services.ports.objects.s3_errors import ObjectStoreUnavailableError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# The port's error codes for a body that stopped before its end.
CUT_OFF = (ResponseStreamingError.__name__, IncompleteReadError.__name__)


class S3Reader:
    """``get_object(**extra)`` is the object's GetObject request (``extra``: a range and its
    condition), ``call(request)`` runs a request with its failures turned into the port's
    errors; ``name`` says which object, in a warning."""

    def __init__(
        self,
        get_object: Callable[..., dict[str, Any]],
        call: Callable[[Callable[[], _T]], _T],
        *,
        attempts: int,
        name: str,
    ) -> None:
        self._get_object, self._call, self._attempts, self._name = get_object, call, attempts, name
        answer = call(get_object)
        self._body, self._etag = answer["Body"], answer["ETag"]
        self._position = 0  # bytes given to the caller
        self._attempt = 1

    def read(self, size: int = -1, /) -> bytes:
        while True:
            try:
                data = self._call(lambda: self._body.read(None if size < 0 else size))
            except ObjectStoreUnavailableError as err:
                if err.code not in CUT_OFF or self._attempt == self._attempts:
                    raise
                self._resume()
                continue
            self._position += len(data)
            return data

    def readinto(self, buffer: Any, /) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> S3Reader:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _resume(self) -> None:
        self._attempt += 1
        log.warning(
            "reading %s was cut off at byte %d (attempt %d of %d); reading on from there",
            self._name,
            self._position,
            self._attempt - 1,
            self._attempts,
        )
        self._body.close()
        extra = {"Range": f"bytes={self._position}-", "IfMatch": self._etag} if self._position else {}
        self._body = self._call(lambda: self._get_object(**extra))["Body"]
