"""The reward service: one reward model served over HTTP, so that rollout workers on small GPUs
need not each hold it (``spotrl reward-server --model PATH``; in a cluster, a Deployment on a
small GPU such as a T4).

    POST /v1/score  {"items": [{"prompt": ..., "response": ...}, ...]}  ->  {"scores": [...]}
    GET  /healthz   {"status": "ok", "fingerprint": ...}

A request is scored as one batch (in chunks of ``CHUNK``), one request at a time on the one
model. The fingerprint changes whenever the model's files do; a run's reward cache keys include
it, so a retrained model is never served its predecessor's cached scores. The client half,
``score_remote``, is what a `reward_model` term with a `url` calls.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from services.api.body_limit import BodyLimit

MAX_ITEMS = 1024
CHUNK = 64
MAX_BODY_BYTES = 64 << 20
TIMEOUT_S = 60.0


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(max_length=100_000)
    response: str = Field(max_length=100_000)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ScoreItem] = Field(min_length=1, max_length=MAX_ITEMS)


class ScoreResponse(BaseModel):
    scores: list[float]


class Health(BaseModel):
    status: str
    fingerprint: str = Field(description="Changes whenever the served model's files change.")


def model_fingerprint(path: Path) -> str:
    """Names, sizes and modification times of the model's files: a retrained model differs."""
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    return ";".join(f"{p.relative_to(path)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def create_reward_app(model_path: Path) -> FastAPI:
    from trainer_core.supervised.reward_model import RewardModel

    lock = threading.Lock()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.model = RewardModel.load(model_path)
        app.state.fingerprint = model_fingerprint(model_path)
        yield

    app = FastAPI(title="spotrl reward service", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit_for=lambda _: MAX_BODY_BYTES)

    def score(items: Sequence[ScoreItem]) -> list[float]:
        with lock:  # one model: concurrent requests take turns, each scored as its own batch
            scores: list[float] = []
            for i in range(0, len(items), CHUNK):
                chunk = items[i : i + CHUNK]
                scores += app.state.model.score([it.prompt for it in chunk], [it.response for it in chunk])
            return scores

    @app.post("/v1/score", response_model=ScoreResponse)
    async def score_route(request: ScoreRequest) -> ScoreResponse:
        return ScoreResponse(scores=await run_in_threadpool(score, request.items))

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return Health(status="ok", fingerprint=app.state.fingerprint)

    return app


@functools.lru_cache(maxsize=8)
def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url.rstrip("/"), timeout=TIMEOUT_S)  # kept alive for the worker's life


def remote_fingerprint(url: str) -> str:
    """The fingerprint of the model the service at ``url`` serves."""
    response = _client(url).get("/healthz")
    response.raise_for_status()
    return Health.model_validate(response.json()).fingerprint


def score_remote(url: str, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """Scores of (prompt, response) pairs from the service at ``url``, in requests of MAX_ITEMS."""
    scores: list[float] = []
    for i in range(0, len(prompts), MAX_ITEMS):
        items = [{"prompt": p, "response": r} for p, r in zip(prompts[i : i + MAX_ITEMS], responses[i : i + MAX_ITEMS], strict=True)]
        response = _client(url).post("/v1/score", json={"items": items})
        response.raise_for_status()
        scores += ScoreResponse.model_validate(response.json()).scores
    return scores
