"""The API app inside the test process, its lifespan running, behind an httpx client (no socket)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from services.control.api.main import create_app
from services.core.config import Settings


@contextlib.asynccontextmanager
async def app_client(settings: Settings, **updates: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The API on ``settings`` with ``updates``, without its scheduler loop (validation and
    bookkeeping only); the client's ``app`` is the app, for a test that reaches its backends."""
    app = create_app(settings.model_copy(update=updates), with_scheduler=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://spotrl") as client,
    ):
        client.app = app  # type: ignore[attr-defined]
        yield client
