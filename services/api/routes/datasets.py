"""/v1/datasets: upload a prompt set (JSONL) into the caller's part of the object store."""

from __future__ import annotations

from fastapi import APIRouter, Request, status

from services.api import service
from services.api.deps import BackendsDep, PrincipalDep, SettingsDep
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
async def upload_dataset(request: Request, backends: BackendsDep, settings: SettingsDep, principal: PrincipalDep) -> DatasetPublic:
    """Store a JSONL prompt set (at most SPOTRL_MAX_DATASET_BYTES, refused unread when it says it
    is larger, and as soon as it grows larger), parsed line by line as it arrives; a run names it
    with the returned `uri` as its `prompts`."""
    return await service.create_dataset(
        backends=backends, principal=principal, body=request.stream(), max_bytes=settings.max_dataset_bytes
    )
