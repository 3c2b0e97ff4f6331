"""Shared fixtures: settings on a temporary home, and the API app with its lifespan running."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from services.api.main import create_app
from services.config import Settings


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
    return Settings(home=tmp_path / "home", model_cache=cache, tick_seconds=0.2, session_timeout_s=3.0, stop_grace_s=10.0)


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The API without its scheduler loop: validation and bookkeeping only."""
    app = create_app(settings, with_scheduler=False)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://spotrl") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client
