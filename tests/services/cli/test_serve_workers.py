"""`spotrl serve --workers N`, a real server: N API processes answer on one port; a stop ends
them all with status 0, and a worker that dies ends the others and the server with its status."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers.process import end, free_port, gone, wait_until_it_answers

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the workers in /proc")


@contextlib.contextmanager
def serving(tmp_path: Path, workers: int) -> Iterator[tuple[subprocess.Popen, httpx.Client, list[int]]]:
    """`spotrl serve --no-scheduler --workers N` on a free port, a client of it, and its workers' pids."""
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "serve", "--no-scheduler", "--workers", str(workers)]
        + ["--port", str(port)],
        env={**os.environ, "SPOTRL_HOME": str(tmp_path / "home")},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        wait_until_it_answers(proc, "spotrl serve", lambda: client.get("/readyz").status_code == 200, log, timeout_s=90)
        yield proc, client, _workers(proc.pid)
    finally:
        client.close()
        end(proc)


def _workers(pid: int) -> list[int]:
    """The API processes `pid` started (multiprocessing's spawned children, not its resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    workers = []
    for child in map(int, children):
        command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing.spawn" in command and b"resource_tracker" not in command:
            workers.append(child)
    return workers


def test_the_workers_answer_and_a_stop_ends_them_all_with_status_0(tmp_path: Path) -> None:
    with serving(tmp_path, workers=2) as (proc, client, workers):
        assert len(workers) == 2
        for _ in range(20):  # a connection each: the kernel hands them to either worker
            with httpx.Client(base_url=client.base_url, timeout=30) as fresh:
                assert fresh.get("/v1/runs").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert gone(workers)


def test_a_worker_that_dies_ends_the_other_and_the_server_with_its_status(tmp_path: Path) -> None:
    with serving(tmp_path, workers=2) as (proc, _client, workers):
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
        assert gone(workers[1:], timeout_s=30)
