"""How many dataset uploads one API process reads at once: at most ``per_server``, and at most
``per_tenant`` of one tenant's. An upload beyond them is refused before its body is read
(``TooManyUploadsError``, answered 429 with Retry-After), not queued: a queued upload would hold
its connection and the client's body meanwhile.

The counts are kept on the event loop's thread (taken and given back in ``async`` code, with no
``await`` between the check and the count), so they need no lock.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

# Seconds a refused client is asked to wait: about the time a large upload takes to be read.
RETRY_AFTER_S = 5


class TooManyUploadsError(RuntimeError):
    """Every upload slot of the server, or of the caller's tenant, is taken (the API answers 429)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = RETRY_AFTER_S


class UploadSlots:
    def __init__(self, *, per_server: int, per_tenant: int) -> None:
        self.per_server = per_server
        self.per_tenant = per_tenant
        self._held: Counter[str] = Counter()

    @property
    def held(self) -> int:
        return self._held.total()

    @contextlib.contextmanager
    def hold(self, tenant: str) -> Iterator[None]:
        """A slot for one upload of ``tenant`` while the block runs; TooManyUploadsError if none is free."""
        if self.held >= self.per_server:
            raise TooManyUploadsError(f"this server reads at most {self.per_server} uploads at once: try again shortly")
        if self._held[tenant] >= self.per_tenant:
            raise TooManyUploadsError(
                f"this server reads at most {self.per_tenant} uploads of one tenant at once: try again shortly"
            )
        self._held[tenant] += 1
        try:
            yield
        finally:
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]
