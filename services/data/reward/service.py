"""The reward service: a reward model, or a user's own reward function, served over HTTP.

``spotrl reward-server --model PATH`` serves a reward model, so that rollout workers on small
GPUs need not each hold it (in a cluster, a Deployment on a small GPU such as a T4).
``spotrl reward-server --function rewards.py:compute_score`` serves a verl-style reward
function from a pool of contained worker processes (`services.data.reward.function_pool`).

    POST /v1/score  {"items": [{"prompt": ..., "response": ..., "data_source": ...,
                                "ground_truth": ..., "extra_info": {...}}, ...]}
                ->  {"scores": [1.0, 0.0], "failures": [null, "timeout"], "metrics": [{"acc": 1.0}, null]}
    GET  /healthz   {"status": "ok", "fingerprint": ...}

A model reads prompt and response; a function reads response (verl's ``solution_str``),
data_source, ground_truth (any JSON value) and extra_info (a JSON object). A response whose
function failed scores 0.0, and ``failures`` says why in one word (`Failure`); user code's
exception text never leaves the workers, and no error repeats what a request sent.

A model scores a request as one batch (in chunks of ``CHUNK``), one request at a time. The
fingerprint changes whenever the model's files, or the function's source, do; a run's reward
cache keys include it, so an edited reward is never served its predecessor's cached scores.
The client half, ``score_remote``, is what a `reward_model` term with a `url` calls.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from services.core.body_limit import BodyLimit
from services.core.validation_errors import unprocessable
from services.data.reward.function_pool import FunctionPool
from services.data.reward.user_function import Failure, Item

MAX_ITEMS = 1024
CHUNK = 64
MAX_BODY_BYTES = 64 << 20
MAX_TEXT_CHARS = 100_000
MAX_JSON_CHARS = 100_000  # a ground_truth or extra_info, as JSON
TIMEOUT_S = 60.0


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field("", max_length=MAX_TEXT_CHARS, description="Read by a reward model.")
    response: str = Field(max_length=MAX_TEXT_CHARS, description="The response scored (verl's solution_str).")
    data_source: str = Field("", max_length=256, description="Passed to a reward function as verl's data_source.")
    ground_truth: JsonValue = Field(None, description="The reference answer: text or any JSON value.")
    extra_info: dict[str, JsonValue] | None = Field(
        None, description="Passed to a reward function as verl's extra_info."
    )

    @field_validator("ground_truth", "extra_info")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        if value is not None and len(json.dumps(value)) > MAX_JSON_CHARS:
            raise ValueError(f"at most {MAX_JSON_CHARS} characters as JSON")
        return value


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ScoreItem] = Field(min_length=1, max_length=MAX_ITEMS)


class ScoreResponse(BaseModel):
    scores: list[float]
    failures: list[Failure | None] = Field(
        [], description="Per item, why it scored 0.0 (a `Failure`); null when scored."
    )
    metrics: list[dict[str, float] | None] = Field([], description="Per item, a function's other numeric results.")


class Health(BaseModel):
    status: str
    fingerprint: str = Field(description="Changes whenever the served model's files, or the function's source, change.")


def model_fingerprint(path: Path) -> str:
    """Names, sizes and modification times of the model's files: a retrained model differs."""
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    return ";".join(f"{p.relative_to(path)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def create_reward_app(
    model_path: Path | None = None, *, pool: FunctionPool | None = None, quantize: str | None = None
) -> FastAPI:
    """The service for the reward model at ``model_path`` (loaded quantized as ``quantize`` says:
    "8bit", "4bit" or None, see ``RewardModel.load``), or for the function ``pool`` runs (exactly
    one of the two); the app starts the pool if it is not running, and closes it at stop."""
    if (model_path is None) == (pool is None):
        raise ValueError("the reward service serves a reward model or a reward function: give one of the two")
    if quantize is not None and model_path is None:
        raise ValueError("quantize is for a reward model, not a reward function")
    lock = threading.Lock()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if pool is not None:
            await run_in_threadpool(pool.start)
            app.state.fingerprint = pool.fingerprint
        else:
            from trainer_core.supervised.reward_model import RewardModel

            app.state.model = RewardModel.load(model_path, quantize=quantize)  # type: ignore[arg-type]
            app.state.fingerprint = model_fingerprint(model_path)  # type: ignore[arg-type]
            if quantize:  # its scores differ from the full model's: cached ones must not mix
                app.state.fingerprint += f";quantize={quantize}"
        try:
            yield
        finally:
            if pool is not None:
                await run_in_threadpool(pool.close)

    def score(items: Sequence[ScoreItem]) -> ScoreResponse:
        if pool is not None:
            return _function_scores(pool, items)
        with lock:  # one model: concurrent requests take turns, each scored as its own batch
            scores: list[float] = []
            for i in range(0, len(items), CHUNK):
                chunk = items[i : i + CHUNK]
                scores += app.state.model.score([it.prompt for it in chunk], [it.response for it in chunk])
        return ScoreResponse(scores=scores, failures=[None] * len(scores), metrics=[None] * len(scores))

    app = FastAPI(title="spotrl reward service", version="0.2.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit_for=lambda _: MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return unprocessable(exc.errors())

    @app.post("/v1/score", response_model=ScoreResponse)
    async def score_route(request: ScoreRequest) -> ScoreResponse:
        return await run_in_threadpool(score, request.items)

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return Health(status="ok", fingerprint=app.state.fingerprint)

    return app


def _function_scores(pool: FunctionPool, items: Sequence[ScoreItem]) -> ScoreResponse:
    outcomes = pool.score([Item(it.response, it.ground_truth, it.data_source, it.extra_info) for it in items])
    return ScoreResponse(
        scores=[o.score for o in outcomes],
        failures=[o.failure for o in outcomes],
        metrics=[o.metrics for o in outcomes],
    )


@functools.lru_cache(maxsize=8)
def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url.rstrip("/"), timeout=TIMEOUT_S)  # kept alive for the worker's life


def remote_fingerprint(url: str) -> str:
    """The fingerprint of the model the service at ``url`` serves."""
    response = _client(url).get("/healthz")
    response.raise_for_status()
    return Health.model_validate(response.json()).fingerprint


class RemoteScores(list[float]):
    """The scores of a batch, as a list of floats, with what the service said beside them.

    >>> scores = score_remote(url, ["q"] * 2, ["#### 42", "oops"], ground_truths=["42", "42"])  # doctest: +SKIP
    >>> list(scores), scores.failures, scores.failure_counts()  # doctest: +SKIP
    ([1.0, 0.0], [None, 'exception'], Counter({'exception': 1}))
    """

    def __init__(
        self, scores: Sequence[float], failures: Sequence[str | None], metrics: Sequence[dict[str, float] | None]
    ) -> None:
        super().__init__(scores)
        self.failures = list(failures)  # per item: a `Failure` value, None when scored
        self.metrics = list(metrics)  # per item: a function's other numeric results, or None

    def failure_counts(self) -> Counter[str]:
        """How many items failed, by reason."""
        return Counter(f for f in self.failures if f is not None)


def score_remote(
    url: str,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    data_sources: Sequence[str | None] | None = None,
    ground_truths: Sequence[Any] | None = None,
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
) -> RemoteScores:
    """Scores of (prompt, response) pairs from the service at ``url``, in requests of MAX_ITEMS;
    a reward function also reads each one's data source, ground truth and extra info."""
    n = len(responses)
    columns = {"data_source": data_sources, "ground_truth": ground_truths, "extra_info": extra_infos}
    items: list[dict[str, Any]] = [{"prompt": p, "response": r} for p, r in zip(prompts, responses, strict=True)]
    for key, values in columns.items():
        for item, value in zip(items, values if values is not None else [None] * n, strict=True):
            if value is not None:
                item[key] = dict(value) if key == "extra_info" else value
    scores: list[float] = []
    failures: list[str | None] = []
    metrics: list[dict[str, float] | None] = []
    for i in range(0, n, MAX_ITEMS):
        response = _client(url).post("/v1/score", json={"items": items[i : i + MAX_ITEMS]})
        response.raise_for_status()
        got = ScoreResponse.model_validate(response.json())
        scores += got.scores
        failures += [f.value if f else None for f in got.failures] or [None] * len(
            got.scores
        )  # a service that predates them
        metrics += got.metrics or [None] * len(got.scores)
    return RemoteScores(scores, failures, metrics)
