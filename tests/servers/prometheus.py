"""A real Prometheus (Debian's package, 2.42) for the dashboard tests.

``python -m tests.servers.prometheus`` (run by ``make test``) makes sure the binary is there:
``prometheus`` on PATH is used as it is; otherwise Debian's package is fetched with
``apt-get download`` and unpacked with ``dpkg-deb -x`` into a cache folder outside the repo
(``$SPOTRL_PROMETHEUS_CACHE``, default ``~/.cache/spotrl/prometheus``). Unpacked rather than
installed: the server is a static Go binary that needs none of the package's dependencies (web
assets), nothing runs as a system service, no root is needed, and a second run finds the
binary and does nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.servers.debian import unpack_packages

CACHE = Path(os.environ.get("SPOTRL_PROMETHEUS_CACHE", Path.home() / ".cache" / "spotrl" / "prometheus"))
PACKAGE = "prometheus"


def find_prometheus() -> Path | None:
    """The prometheus binary: on PATH, or unpacked in the cache; None when neither."""
    on_path = shutil.which("prometheus")
    if on_path:
        return Path(on_path)
    cached = CACHE / "usr" / "bin" / "prometheus"
    return cached if os.access(cached, os.X_OK) else None


def ensure_prometheus() -> Path:
    """The prometheus binary, fetched from Debian's archive and unpacked into the cache if absent."""
    found = find_prometheus()
    if found is not None:
        return found
    unpack_packages([PACKAGE], CACHE)
    found = find_prometheus()
    if found is None:
        raise RuntimeError(f"Debian's {PACKAGE} package unpacked into {CACHE} has no usr/bin/prometheus")
    return found


class Prometheus:
    """A Prometheus server on a loopback port, scraping ``targets`` (job name -> host:port)
    every ``interval_s``; its data in ``data_dir``."""

    def __init__(
        self, binary: Path, data_dir: Path, port: int, targets: dict[str, str], interval_s: float = 1.0
    ) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
            for job, target in targets.items()
        )
        config = data_dir / "prometheus.yml"
        every = f"{round(interval_s * 1000)}ms"  # Prometheus durations take no decimals
        config.write_text(
            f"global:\n  scrape_interval: {every}\n  scrape_timeout: {every}\n"
            f"  evaluation_interval: {every}\nscrape_configs:\n{jobs}"
        )
        self.url = f"http://127.0.0.1:{port}"
        self.log = data_dir / "prometheus.log"
        self._proc = subprocess.Popen(
            [
                str(binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={data_dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1d",
            ],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.client.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        """The series of ``expr`` over [start, end]; raises on a query Prometheus refuses."""
        r = self.client.get("/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step_s})
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def close(self) -> None:
        self.client.close()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


if __name__ == "__main__":
    print(ensure_prometheus())
    sys.exit(0)
