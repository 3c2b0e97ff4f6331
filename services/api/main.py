"""Builds the FastAPI app: backends opened at start, scheduler loop alongside, closed at stop."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, status
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from services.api.metrics import RunCollector
from services.api.routes import health, runs
from services.backends.state_store import IllegalTransitionError, RunNotFoundError
from services.config import Settings, get_settings
from services.cost.catalog import load_catalog
from services.prompts import InvalidPromptsError
from services.scheduler.loop import Scheduler
from services.wiring import open_backends


def create_app(settings: Settings | None = None, *, with_scheduler: bool = True) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backends = open_backends(settings)
        app.state.backends = backends
        app.state.catalog = load_catalog()
        app.state.metrics_registry = CollectorRegistry()
        app.state.metrics_registry.register(RunCollector(backends))
        stop = threading.Event()
        app.state.scheduler_thread = None
        if with_scheduler:
            scheduler = Scheduler(backends, settings, app.state.catalog)
            thread = threading.Thread(target=scheduler.run_forever, args=(stop,), name="scheduler", daemon=True)
            thread.start()
            app.state.scheduler_thread = thread
        try:
            yield
        finally:
            stop.set()
            if app.state.scheduler_thread is not None:
                app.state.scheduler_thread.join(timeout=30)
            backends.close()

    app = FastAPI(
        title="spotrl",
        version="0.1.0",
        summary="RL post-training on spot rollout GPUs and just-in-time training GPUs, with per-run cost.",
        lifespan=lifespan,
    )
    app.dependency_overrides[get_settings] = lambda: settings
    app.include_router(health.router)
    app.include_router(runs.router)

    # Domain errors become status codes here, and only here.
    @app.exception_handler(RunNotFoundError)
    async def _not_found(_: Request, exc: RunNotFoundError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_404_NOT_FOUND, content={"detail": f"no run {exc.args[0]!r}"})

    @app.exception_handler(IllegalTransitionError)
    async def _conflict(_: Request, exc: IllegalTransitionError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_409_CONFLICT, content={"detail": str(exc)})

    @app.exception_handler(InvalidPromptsError)
    async def _bad_prompts(_: Request, exc: InvalidPromptsError) -> JSONResponse:
        return JSONResponse(
            status_code=422,
            content={"detail": [{"loc": ["body", "prompts"], "msg": str(exc), "type": "value_error"}]},
        )

    return app
