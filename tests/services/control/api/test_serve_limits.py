"""`spotrl serve` under clients that take more than their share: an upload's memory is bounded
by a constant, not by the set's size; uploads at once are bounded per tenant and per server;
a connection that sends no request head is closed, while requests are still served.

The memory and connection tests run a real `spotrl serve` process: its peak resident memory
(VmHWM in /proc) is what an operator's pod limit is measured against, and the socket handling
is uvicorn's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.control.api import service
from services.control.api.auth import NO_AUTH
from services.control.api.upload_slots import RETRY_AFTER_S, TooManyUploadsError, UploadSlots
from tests.app_client import app_client
from tests.servers.process import end, free_port, wait_until_it_answers

MiB = 1 << 20


@contextlib.contextmanager
def serving(tmp_path: Path, **env: str) -> Iterator[tuple[subprocess.Popen, httpx.Client]]:
    """A real `spotrl serve --no-scheduler` on a free port (``env`` adds settings) and a client of it."""
    port = free_port()
    log = tmp_path / "serve.log"
    environ = {**os.environ, "SPOTRL_HOME": str(tmp_path / "home"), **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "serve", "--no-scheduler", "--port", str(port)],
        env=environ,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        wait_until_it_answers(proc, "spotrl serve", lambda: client.get("/readyz").status_code == 200, log, timeout_s=60)
        yield proc, client
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        end(proc)


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def prompt_lines(size: int) -> bytes:
    """JSONL of short prompt rows, ``size`` bytes or a line more."""
    line = b'{"prompt": "Natalia sold clips to 48 of her friends in April. How many clips did she sell?", "answer": "72"}\n'
    return line * (size // len(line) + 1)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's peak memory in /proc")
def test_an_uploads_peak_memory_is_a_constant_not_a_multiple_of_its_size(tmp_path: Path) -> None:
    size = 40 * MiB
    data = prompt_lines(size)
    with serving(tmp_path, SPOTRL_MAX_DATASET_BYTES=str(64 * MiB)) as (proc, client):
        # A small upload first: what every upload loads (modules, threads, caches) is not counted.
        assert client.post("/v1/datasets", content=prompt_lines(2 * MiB)).status_code == 201
        before = peak_rss(proc.pid)
        r = client.post("/v1/datasets", content=data, headers={"Content-Type": "application/x-ndjson"})
        assert (r.status_code, r.json()["bytes"]) == (201, len(data)), r.text
        growth = peak_rss(proc.pid) - before
    assert r.json()["prompts"] == data.count(b"\n")
    # Held whole (the parsed prompts, then their JSONL), a 40 MiB set grew the server by about 7
    # times its size; written out as it is parsed, it costs a few pieces whatever its size.
    assert growth < size // 4, f"the server grew by {growth / MiB:.0f} MiB for a {size / MiB:.0f} MiB upload"


@pytest.mark.slow
def test_silent_connections_are_closed_and_requests_are_served_meanwhile(tmp_path: Path) -> None:
    timeout_s = 2.0
    with serving(tmp_path, SPOTRL_API_REQUEST_HEAD_TIMEOUT_S=str(timeout_s), SPOTRL_API_KEEP_ALIVE_S="1") as (
        proc,
        client,
    ):
        port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
        trickling = socket.create_connection(("127.0.0.1", port))
        trickling.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        opened = time.monotonic()
        assert client.get("/readyz").status_code == 200  # served while they wait
        kept = httpx.Client(base_url=client.base_url)  # a connection that did send a request, then idles
        assert kept.get("/readyz").status_code == 200
        for s in [*silent, trickling]:
            s.settimeout(timeout_s + 10)
            assert s.recv(1) == b"", "the server closes the connection: end of stream"  # blocks until it does
            s.close()
        assert time.monotonic() - opened < timeout_s + 5
        assert client.get("/readyz").status_code == 200
        kept.close()


async def test_uploads_beyond_the_tenants_and_the_servers_slots_are_429_unread(settings) -> None:
    async with app_client(settings, max_concurrent_uploads=2, max_concurrent_uploads_per_tenant=1) as api:
        r = await api.post("/v1/datasets", content=b'{"prompt": "a"}\n')
        assert r.status_code == 201, r.text
        slots: UploadSlots = api.app.state.upload_slots  # type: ignore[attr-defined]
        with slots.hold(NO_AUTH.tenant):  # an upload of the caller's tenant in flight
            r = await api.post("/v1/datasets", content=b'{"prompt": "a"}\n')
            assert (r.status_code, r.headers["Retry-After"]) == (429, str(RETRY_AFTER_S)), r.text
            assert "of one tenant" in r.json()["detail"]
            with (
                slots.hold("another"),  # and one of another tenant: the server's two are taken
                pytest.raises(TooManyUploadsError, match="at most 2 uploads at once"),
                slots.hold("a third"),
            ):
                pass
        assert slots.held == 0
        r = await api.post("/v1/datasets", content=b'{"prompt": "a"}\n')
        assert r.status_code == 201, r.text
        operation = (await api.get("/openapi.json")).json()["paths"]["/v1/datasets"]["post"]
        assert "429" in operation["responses"]

        pulled = 0

        async def body():
            nonlocal pulled
            pulled += 1
            yield b'{"prompt": "a"}\n'

        backends = api.app.state.backends  # type: ignore[attr-defined]
        with slots.hold(NO_AUTH.tenant), pytest.raises(TooManyUploadsError):
            await service.create_dataset(backends=backends, principal=NO_AUTH, body=body(), max_bytes=MiB, slots=slots)
        assert pulled == 0  # refused before a byte is read
        # A failed upload gives its slot back.
        with pytest.raises(service.SpecFieldError):
            await service.create_dataset(
                backends=backends,
                principal=NO_AUTH,
                body=body(),
                max_bytes=MiB,
                slots=slots,
                fields=service.DatasetFields(prompt_key="question"),
            )
        assert slots.held == 0
