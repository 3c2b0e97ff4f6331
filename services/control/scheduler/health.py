"""The scheduler's health over HTTP, for Kubernetes' probes (``spotrl scheduler --health-port``).

The scheduler serves nothing else, and one that stands by is as healthy as the leader: health is
the reconcile loop going round. Each tick, leading or standing by, asks the state store for the
lease, and then beats the ``Heartbeat``.

- ``/healthz`` (liveness): 200 while the last tick ended less than ``stale_s`` ago (before the
  first one: since the process started), else 503, so that a loop stuck on a call that never
  returns is restarted. A crash needs no probe: the process exits.
- ``/readyz`` (readiness): 200 once a tick has ended (the state store answered) and while live.

HTTP rather than an exec probe reading a heartbeat file: an exec probe forks a process in the
container at every probe (a Python one costs about a second of CPU), a shell one depends on the
image's tools, and the kubelet's HTTP probes come from the node, which NetworkPolicies always admit.
"""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

# A tick stops early once it has outlasted the lease (10 s by default); two minutes without one
# ending is a loop that is stuck, not a slow one.
STALE_S = 120.0


class Heartbeat:
    """When the scheduler's loop last went round (monotonic seconds)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.last: float | None = None  # None until the first tick ends

    def beat(self) -> None:
        self.last = time.monotonic()

    def live(self, stale_s: float) -> bool:
        return time.monotonic() - (self.last if self.last is not None else self.started) < stale_s

    def ready(self, stale_s: float) -> bool:
        return self.last is not None and self.live(stale_s)


def serve_health(
    heartbeat: Heartbeat, port: int, host: str = "0.0.0.0", stale_s: float = STALE_S
) -> http.server.ThreadingHTTPServer:
    """Serve ``/healthz`` and ``/readyz`` from a daemon thread; ``shutdown()`` the server to stop."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            checks = {"/healthz": heartbeat.live, "/readyz": heartbeat.ready}
            if self.path not in checks:
                self.send_error(404)
                return
            ok = checks[self.path](stale_s)
            body = b"ok\n" if ok else b"the scheduler's loop has not gone round lately\n"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # a probe every few seconds is not news
            pass

    server = http.server.ThreadingHTTPServer((host, port), Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
