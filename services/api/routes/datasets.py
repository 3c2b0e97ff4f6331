"""/v1/datasets: upload a prompt set (JSONL) into the caller's part of the object store."""

from __future__ import annotations

from fastapi import APIRouter, Request, status
from fastapi.concurrency import run_in_threadpool

from services.api import service
from services.api.deps import BackendsDep, PrincipalDep
from services.api.responses import errors
from services.api.schemas import DatasetPublic

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=errors(401))

JSONL_BODY = {
    "required": True,
    "content": {
        "application/x-ndjson": {
            "schema": {"type": "string", "description": 'One {"prompt": ..., "answer": ...} object per line.'}
        }
    },
}


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=DatasetPublic, responses=errors(413, 422),
    openapi_extra={"requestBody": JSONL_BODY},
)  # fmt: skip
async def upload_dataset(request: Request, backends: BackendsDep, principal: PrincipalDep) -> DatasetPublic:
    """Store a JSONL prompt set (at most SPOTRL_MAX_DATASET_BYTES, refused unread when larger);
    a run names it with the returned `uri` as its `prompts`."""
    data = await request.body()  # bounded by the body-size middleware before it is read
    return await run_in_threadpool(service.create_dataset, backends=backends, principal=principal, data=data)
