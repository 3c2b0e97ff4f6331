"""How `spotrl serve` runs the app on uvicorn: bounded connections and timeouts.

uvicorn closes a connection idle between requests after ``timeout_keep_alive``, but arms that
timer only once a response is sent: a connection that never sends a whole request head (a
silent socket, or one trickling its headers) would be held for ever. ``HeadTimeoutH11Protocol``
closes such a connection ``head_timeout_s`` after it opened, or after its last response. A head
is at most h11's 16 KiB (uvicorn's default ``h11_max_incomplete_event_size``); a request longer
than that is answered 400. ``limit_concurrency`` caps the connections and requests served at
once (503 beyond), and ``timeout_graceful_shutdown`` bounds how long a stop waits for requests in
flight.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.core.config import Settings


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not whole in time."""

    head_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """The timer runs while the connection waits for a request head, from when it began to wait."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not waiting:
            self._stop_head_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_for(settings: Settings) -> type[HeadTimeoutH11Protocol]:
    """The protocol class with this server's head timeout."""
    return type(
        "HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,), {"head_timeout_s": settings.api_request_head_timeout_s}
    )


def uvicorn_options(settings: Settings, *, access_log: bool = False) -> dict[str, object]:
    """uvicorn.run's options from the settings (besides the app, host and port). ``access_log``:
    a line in the log per request, which costs the server some 0.1 ms of CPU a request (a tenth
    of what a read of a run costs in all): off unless asked for."""
    return {
        "http": protocol_for(settings),
        "timeout_keep_alive": settings.api_keep_alive_s,
        "limit_concurrency": settings.api_max_connections,
        "timeout_graceful_shutdown": settings.api_shutdown_grace_s,
        "access_log": access_log,
    }
