"""/v1/datasets: upload a prompt set (JSONL or Parquet) into the caller's part of the object store."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, status

from services.control.api import service
from services.control.api.deps import BackendsDep, PrincipalDep, SettingsDep, UploadSlotsDep
from services.control.api.responses import errors
from services.control.api.schemas import DatasetPublic
from services.domain.prompt_items import DatasetFields
from services.domain.prompts import PARQUET_MEDIA_TYPE

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=errors(401))

DATASET_BODY = {
    "required": True,
    "content": {
        "application/x-ndjson": {
            "schema": {
                "type": "string",
                "description": 'One row per line: {"prompt": ..., "answer": ...}, or verl\'s layout ({"data_source", "prompt": '
                '[chat messages], "ability", "reward_model": {"style", "ground_truth"}, "extra_info"}).',
            }
        },
        PARQUET_MEDIA_TYPE: {
            "schema": {
                "type": "string",
                "format": "binary",
                "description": "A Parquet file of the same rows (verl's layout).",
            }
        },
    },
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=DatasetPublic,
    responses=errors(413, 422, 429),
    openapi_extra={"requestBody": DATASET_BODY},
)
async def upload_dataset(
    request: Request,
    backends: BackendsDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    fields: Annotated[DatasetFields, Query()],
    slots: UploadSlotsDep,
) -> DatasetPublic:
    """Store a prompt set (at most SPOTRL_MAX_DATASET_BYTES, refused unread when it says it is
    larger, and as soon as it grows larger) as normalised JSONL, its rows mapped by `prompt_key`
    and `answer_key` as a run spec's `dataset` maps them. JSONL is parsed line by line as it
    arrives; Parquet (Content-Type application/vnd.apache.parquet, or a body starting with its
    magic bytes) is spooled to a temporary file, then read. A run names the set with the
    returned `uri` as its `prompts`. A server reads at most SPOTRL_MAX_CONCURRENT_UPLOADS uploads at
    once, and SPOTRL_MAX_CONCURRENT_UPLOADS_PER_TENANT of one tenant: one more gets 429 with
    Retry-After, unread."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return await service.create_dataset(
        backends=backends,
        principal=principal,
        body=request.stream(),
        max_bytes=settings.max_dataset_bytes,
        media_type=media_type,
        fields=fields,
        slots=slots,
    )
