"""Shared fixtures: settings on a temporary home, and the API app with its lifespan running."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from services.core.config import Settings
from tests.app_client import app_client

# Real servers for the production adapters' tests, each started once per session on free
# loopback ports (tests/servers/<name>.py).
pytest_plugins: list[str] = [
    "tests.servers.redis",
    "tests.servers.postgres",
    "tests.servers.s3",
    "tests.servers.kafka",
    "tests.servers.kube",
]


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the tests share the machine's few cores with the processes they
    start (pods, servers, ranks), and threads on a busy core wait on each other (measured 5-30x
    slower per step with two threads on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def settings(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    # Converted base models are shared by the tests of a session; run state is per test.
    cache = tmp_path_factory.getbasetemp() / "models"
    # A short lease: a test that "kills" a scheduler waits one lease period for its successor.
    # The one server directory a spec may name paths in: a test puts the files it names there.
    (tmp_path / "data").mkdir()
    return Settings(
        home=tmp_path / "home",
        model_cache=cache,
        tick_seconds=0.2,
        lease_seconds=2.0,
        session_timeout_s=3.0,
        stop_grace_s=10.0,
        data_dirs=str(tmp_path / "data"),
    )


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The API without its scheduler loop: validation and bookkeeping only."""
    async with app_client(settings) as client:
        yield client


@pytest.fixture
def wait_for():  # returns `wait` below
    """`wait_for(predicate, timeout_s=30.0, message=...)` polls `predicate` until it returns
    something truthy, and returns that; the test fails once `timeout_s` has passed.

    For tests that wait on another process or thread: assert on the event awaited (a state, a
    file, a log line, a record), never on how long it took. The deadline only bounds a hang, so
    it is generous: a busy CI machine must not fail a correct test.
    """
    import time
    from collections.abc import Callable

    def wait(predicate: Callable[[], object], timeout_s: float = 30.0, message: str = "the condition held") -> object:
        deadline = time.monotonic() + timeout_s
        while not (value := predicate()):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s} s waiting until {message}")
            time.sleep(0.05)
        return value

    return wait
