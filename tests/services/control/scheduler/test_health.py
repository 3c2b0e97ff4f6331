"""The scheduler's health endpoint, which the chart's liveness and readiness probes ask
(services/control/scheduler/health.py): in-process, and from a real `spotrl scheduler --health-port`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from services.control.scheduler.health import Heartbeat, serve_health
from services.core.config import Settings
from tests.servers.process import free_port


def status(url: str) -> int | None:
    """The HTTP status of a GET of ``url``; None while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError):
        return None


def test_health_says_whether_the_loop_goes_round() -> None:
    heartbeat = Heartbeat()
    port = free_port()
    server = serve_health(heartbeat, port, host="127.0.0.1", stale_s=60.0)
    base = f"http://127.0.0.1:{port}"
    try:
        # Started, no tick yet: alive (the state store may be slow to answer), not ready.
        assert (status(f"{base}/healthz"), status(f"{base}/readyz")) == (200, 503)
        heartbeat.beat()
        assert (status(f"{base}/healthz"), status(f"{base}/readyz")) == (200, 200)
        assert heartbeat.last is not None
        heartbeat.last -= 61.0  # the last tick ended 61 s ago: a loop stuck on a call
        assert (status(f"{base}/healthz"), status(f"{base}/readyz")) == (503, 503)
        assert status(f"{base}/metrics") == 404
    finally:
        server.shutdown()
        server.server_close()


def test_the_scheduler_command_serves_its_health(settings: Settings, tmp_path: Path, wait_for) -> None:
    port = free_port()
    env = {**os.environ, **settings.pod_env(), "SPOTRL_TICK_SECONDS": "0.2", "SPOTRL_LEASE_SECONDS": "2"}
    with (tmp_path / "scheduler.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "scheduler", "--health-port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: status(f"http://127.0.0.1:{port}/readyz") == 200, message="the scheduler has ticked")
        assert status(f"http://127.0.0.1:{port}/healthz") == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "scheduler.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
