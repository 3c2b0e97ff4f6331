"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.api.deps import BackendsDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(backends: BackendsDep, request: Request) -> Response:
    def check() -> list[str]:
        problems = []
        try:
            backends.state.list_runs(active_only=True)
        except Exception as e:  # readiness reports any backend failure instead of raising it
            problems.append(f"state store: {e}")
        scheduler = request.app.state.scheduler_thread
        if scheduler is not None and not scheduler.is_alive():
            problems.append("scheduler loop is not running")
        return problems

    problems = await run_in_threadpool(check)
    if problems:
        return Response(content="; ".join(problems), status_code=503)
    return Response(content="ready")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(generate_latest, request.app.state.metrics_registry)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)
