"""Builds the FastAPI app: backends opened at start, scheduler loop alongside, closed at stop."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.api.auth import TokenBook
from services.api.body_limit import BodyLimit
from services.api.metrics import RunCollector
from services.api.routes import datasets, health, plan, runs
from services.api.service import InvalidCursorError, PodNotOfRunError, SpecFieldError
from services.backends.state_store import IllegalTransitionError, RunNotFoundError
from services.config import Settings, get_settings
from services.cost.live_prices import load_prices
from services.cost.planner import PlanError
from services.prompts import InvalidPromptsError
from services.scheduler.loop import Scheduler
from services.wiring import open_backends


def _short(part: object) -> object:
    """A location part as it goes back to the client: an unknown field's name, cut short."""
    return part[:100] if isinstance(part, str) else part


def _methods_at(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``app`` serves at ``path``."""
    methods = set()
    for route in app.router.routes:
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= route_methods
    return sorted(methods)


def create_app(settings: Settings | None = None, *, with_scheduler: bool = True) -> FastAPI:
    settings = settings or get_settings()
    # Read now, so that a bad tokens file stops the server at start with what to fix.
    tokens = TokenBook(settings.tokens_file) if settings.tokens_file is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The threads that run the routes' blocking work: few, since they share one GIL and the
        # state store's connection pool, and more only queue on those.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        backends = open_backends(settings)
        app.state.backends = backends
        app.state.catalog = load_prices(settings)
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
            backends.close()

    app = FastAPI(
        title="spotrl",
        version="0.1.0",
        summary="RL post-training on spot rollout GPUs and just-in-time training GPUs, with per-run cost.",
        lifespan=lifespan,
    )
    app.state.tokens = tokens
    app.state.settings = settings
    app.include_router(health.router)
    app.include_router(runs.router)
    app.include_router(datasets.router)
    app.include_router(plan.router)
    app.add_middleware(
        BodyLimit,
        limit_for=lambda path: settings.max_dataset_bytes if path == "/v1/datasets" else settings.max_body_bytes,
    )

    # Domain errors become status codes here, and only here. No response repeats what the
    # client sent: a validation error names the field and the rule, not the value.
    def unprocessable(loc: tuple | list, message: str, kind: str = "value_error") -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": [{"loc": list(loc), "msg": message, "type": kind}]})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            # Starlette names the methods of one route; a path is served by a route per method.
            headers["Allow"] = ", ".join(_methods_at(app, request.url.path))
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail}, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [{"loc": [_short(part) for part in e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.exception_handler(RunNotFoundError)
    async def _not_found(_: Request, exc: RunNotFoundError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_404_NOT_FOUND, content={"detail": "no such run"})

    @app.exception_handler(PodNotOfRunError)
    async def _no_pod(_: Request, exc: PodNotOfRunError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_404_NOT_FOUND, content={"detail": "no such pod of this run"})

    @app.exception_handler(IllegalTransitionError)
    async def _conflict(_: Request, exc: IllegalTransitionError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_409_CONFLICT, content={"detail": str(exc)})

    @app.exception_handler(InvalidCursorError)
    async def _bad_cursor(_: Request, exc: InvalidCursorError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_400_BAD_REQUEST, content={"detail": str(exc)})

    @app.exception_handler(SpecFieldError)
    async def _bad_field(_: Request, exc: SpecFieldError) -> JSONResponse:
        return unprocessable(exc.loc, str(exc))

    @app.exception_handler(PlanError)
    async def _no_plan(_: Request, exc: PlanError) -> JSONResponse:
        return unprocessable(("body", *exc.loc), str(exc))

    @app.exception_handler(InvalidPromptsError)
    async def _bad_prompts(_: Request, exc: InvalidPromptsError) -> JSONResponse:
        return unprocessable(("body", "prompts"), str(exc))

    return app
