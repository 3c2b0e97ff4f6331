"""Builds the FastAPI app: backends opened at start, scheduler loop alongside, closed at stop."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from services.control.api.auth import TokenBook
from services.control.api.error_handlers import add_error_handlers
from services.control.api.kept import Kept
from services.control.api.metrics import RunCollector
from services.control.api.routes import datasets, docs, health, plan, runs
from services.control.scheduler.loop import Scheduler
from services.core.body_limit import BodyLimit
from services.core.config import Settings, get_settings
from services.ports.wiring import open_backends, open_prices


def create_app(settings: Settings | None = None, *, with_scheduler: bool = True) -> FastAPI:
    """The API; ``with_scheduler`` also runs the reconcile loop in a thread of this process
    (``spotrl serve``'s default), else it serves beside ``spotrl scheduler`` processes."""
    settings = settings or get_settings()
    # Read now, so that a bad tokens file stops the server at start with what to fix.
    tokens = TokenBook(settings.tokens_file) if settings.tokens_file is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The threads that run the routes' blocking work: few, since they share one GIL and the
        # state store's connection pool, and more only queue on those. The runs' routes hand their
        # work to a plain executor (a call costs half what it does through anyio's worker
        # threads); uploads and the health routes use anyio's, held to as many.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        app.state.threads = ThreadPoolExecutor(settings.api_threads, thread_name_prefix="api")
        backends = open_backends(settings)
        app.state.backends = backends
        app.state.catalog = open_prices(settings)
        app.state.kept = Kept(app.state.catalog)
        app.state.metrics_registry = CollectorRegistry()
        app.state.metrics_registry.register(RunCollector(backends, app.state.catalog))
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
            app.state.threads.shutdown(wait=True)  # no request's work left on the backends
            backends.close()

    app = FastAPI(
        title="spotrl",
        version="0.1.0",
        summary="RL post-training on spot rollout GPUs and just-in-time training GPUs, with per-run cost.",
        lifespan=lifespan,
        # No redirect to the path with or without a trailing slash: Starlette builds its URL from the
        # client's Host header. `/v1/runs/` is a 404.
        redirect_slashes=False,
        # /docs is routes/docs.py's, its assets served from here; ReDoc's page would load a CDN's script.
        docs_url=None,
        redoc_url=None,
    )
    app.state.tokens = tokens
    app.state.settings = settings
    app.include_router(health.router)
    app.include_router(runs.router)
    app.include_router(datasets.router)
    app.include_router(plan.router)
    app.include_router(docs.router)
    app.add_middleware(
        BodyLimit,
        limit_for=lambda path: settings.max_dataset_bytes if path == "/v1/datasets" else settings.max_body_bytes,
    )

    add_error_handlers(app)
    return app
