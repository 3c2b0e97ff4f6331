"""Liveness, readiness and Prometheus metrics (plain text, not JSON)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.control.api.deps import BackendsDep, require_admin
from services.control.api.responses import errors

router = APIRouter(tags=["health"])


def _text(description: str, media_type: str = "text/plain") -> dict:
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_class=PlainTextResponse,
    responses={200: _text("`ready`"), 503: _text("What is not ready, one problem per `;`.")},
)
async def readyz(backends: BackendsDep, request: Request) -> PlainTextResponse:
    def check() -> list[str]:
        problems = []
        try:
            backends.state.list_runs(active_only=True, limit=1)
        except Exception as e:  # readiness reports any backend failure instead of raising it
            problems.append(f"state store: {type(e).__name__}")  # not the message: it may hold a URL with a password
        tokens = request.app.state.tokens
        if tokens is not None and tokens.problem() is not None:
            problems.append(
                "tokens file is missing or invalid (the server's log says why)"
            )  # not its path: /readyz is open
        scheduler = request.app.state.scheduler_thread
        if scheduler is not None and not scheduler.is_alive():
            problems.append("scheduler loop is not running")
        return problems

    problems = await run_in_threadpool(check)
    if problems:
        return PlainTextResponse("; ".join(problems), status_code=503)
    return PlainTextResponse("ready")


@router.get(
    "/metrics",
    response_class=Response,
    dependencies=[Depends(require_admin)],
    responses={200: _text("Prometheus text exposition.", CONTENT_TYPE_LATEST), **errors(401, 403)},
)
async def metrics(request: Request) -> Response:
    """Per-run operating figures (no prompts, no spec); needs an admin token when tokens are configured."""
    body = await run_in_threadpool(generate_latest, request.app.state.metrics_registry)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)
