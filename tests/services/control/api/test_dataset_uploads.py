"""POST /v1/datasets and run specs with the prompt sets users have: Parquet and JSONL in verl's
layout, field mappings, a directory saved by datasets; bounded, and refused by row and field."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.control.api import service
from services.control.api.auth import NO_AUTH
from services.domain.names import tenant_object_key
from services.domain.prompts import PARQUET_MEDIA_TYPE, parse_jsonl, to_jsonl
from tests.app_client import app_client
from tests.services.domain.verl_rows import gsm8k_rows, jsonl, parquet

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PARQUET = {"Content-Type": PARQUET_MEDIA_TYPE}


def spec(**changes) -> dict:
    return {
        "model": "tiny",
        "prompts": [{"prompt": "1+1", "answer": "2"}],
        "batch_samples": 8,
        "iterations": 2,
        **changes,
    }


async def chunked(data: bytes, size: int):
    """``data`` in pieces of ``size`` bytes, with no Content-Length: counted as it arrives."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def stored(api: httpx.AsyncClient, uri: str) -> bytes:
    return api.app.state.backends.objects.get_bytes(tenant_object_key(NO_AUTH.tenant, uri.removeprefix("store://")))  # type: ignore[attr-defined]


async def test_a_parquet_upload_is_stored_as_the_normalised_jsonl_of_its_rows(api: httpx.AsyncClient) -> None:
    rows = gsm8k_rows(3000)
    data = parquet(rows, row_group_size=1000)
    expected = to_jsonl(parse_jsonl(jsonl(rows), "the same rows as JSONL"))
    # Told by its media type, or by its first bytes; sent whole, or streamed without a length.
    for content, headers in (
        (data, PARQUET),
        (chunked(data, 50_000), PARQUET),
        (data, {"Content-Type": "application/octet-stream"}),
    ):
        r = await api.post("/v1/datasets", content=content, headers=headers)
        assert (r.status_code, r.json()["prompts"], r.json()["bytes"]) == (201, 3000, len(data)), r.text
        assert stored(api, r.json()["uri"]) == expected
    run = await api.post("/v1/runs", json=spec(prompts=r.json()["uri"]))
    assert (run.status_code, run.json()["prompt_count"]) == (201, 3000), run.text
    # verl's layout as JSONL uploads alike.
    r = await api.post("/v1/datasets", content=jsonl(rows), headers={"Content-Type": "application/x-ndjson"})
    assert (r.status_code, stored(api, r.json()["uri"])) == (201, expected)


async def test_an_upload_maps_its_fields_as_the_query_says(api: httpx.AsyncClient) -> None:
    rows = [{"question": f"{i} + 1?", "solution": {"final": str(i + 1)}, "level": 1} for i in range(4)]
    for data in (parquet(rows), jsonl(rows)):
        r = await api.post("/v1/datasets?prompt_key=question&answer_key=solution.final", content=data)
        assert r.status_code == 201, r.text
        items = parse_jsonl(stored(api, r.json()["uri"]), "the stored set")
        assert [(i.prompt, i.answer, i.extra_info) for i in items] == [
            (f"{i} + 1?", str(i + 1), {"level": 1}) for i in range(4)
        ]
        r = await api.post("/v1/datasets", content=data)  # no mapping: no `prompt`
        assert (r.status_code, r.json()["detail"][0]["loc"]) == (422, ["body"])
        assert "row 1 is not a prompt row: prompt: Field required" in r.json()["detail"][0]["msg"].replace(
            "line", "row"
        )
    r = await api.post("/v1/datasets?answer_key=a..b", content=parquet(rows))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "answer_key"]


async def test_a_parquet_upload_over_its_limit_is_413_as_it_streams(settings) -> None:
    data = parquet(gsm8k_rows(400))
    limit = len(data) - 1
    async with app_client(settings, max_dataset_bytes=limit) as api:
        for content in (data, chunked(data, 4096)):
            r = await api.post("/v1/datasets", content=content, headers=PARQUET)
            assert r.status_code == 413, r.text
            assert f"{limit} bytes" in r.json()["detail"]
        r = await api.post("/v1/datasets", content=parquet(gsm8k_rows(20)), headers=PARQUET)
        assert r.status_code == 201, r.text


async def test_the_spool_is_refused_at_the_first_piece_past_the_limit(api: httpx.AsyncClient) -> None:
    """Parquet is read only once whole, but the body stops being read, and spooled, at the limit."""
    pulled = 0

    async def body():
        nonlocal pulled
        for piece in (b"PAR1", *[b"\0" * (256 << 10)] * 40):  # then 40 pieces of 256 kB
            pulled += 1
            yield piece

    backends = api.app.state.backends  # type: ignore[attr-defined]
    with pytest.raises(service.BodyTooLargeError, match="limit of 600000 bytes"):
        await service.create_dataset(backends=backends, principal=NO_AUTH, body=body(), max_bytes=600_000)
    assert pulled == 4


async def test_a_bad_parquet_upload_is_422_naming_the_row_and_field_not_the_content(api: httpx.AsyncClient) -> None:
    rows = gsm8k_rows(5)
    rows[3]["prompt"] = [{"role": "user", "content": SECRET, "tool_calls": SECRET}]
    r = await api.post("/v1/datasets", content=parquet(rows), headers=PARQUET)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["msg"] == (
        "the upload row 4 is not a prompt row: prompt.0.(field 3): unknown field; remove it from the file"
    )
    for content in (b"PAR1" + SECRET.encode(), SECRET.encode() + b"PAR1"):  # not Parquet, said to be
        r = await api.post("/v1/datasets", content=content, headers=PARQUET)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["msg"] == "the upload is not a Parquet file that can be read"
        assert SECRET not in r.text


async def test_a_spec_names_parquet_and_saved_datasets_on_the_server_with_its_field_mapping(
    api: httpx.AsyncClient, tmp_path: Path
) -> None:
    import datasets

    data_dir = tmp_path / "data"
    rows = [{"question": f"{i} + 2?", "solution": {"final": str(i + 2)}} for i in range(6)]
    parquet(rows, data_dir / "train.parquet")
    datasets.Dataset.from_list(rows[:2]).save_to_disk(str(data_dir / "test"))
    mapped = spec(
        prompts=str(data_dir / "train.parquet"),
        dataset={"prompt_key": "question", "answer_key": "solution.final"},
        eval={"prompts": str(data_dir / "test")},
    )
    r = await api.post("/v1/runs", json=mapped)
    assert (r.status_code, r.json()["prompt_count"]) == (201, 6), r.text
    assert r.json()["spec"]["dataset"] == {"prompt_key": "question", "answer_key": "solution.final"}
    run_id = r.json()["id"]
    objects = api.app.state.backends.objects  # type: ignore[attr-defined]
    items = parse_jsonl(objects.get_bytes(f"runs/{run_id}/prompts.jsonl"), "the run's set")
    assert [(i.prompt, i.answer) for i in items] == [(f"{i} + 2?", str(i + 2)) for i in range(6)]
    # Unmapped, the rows hold no `prompt`: 422 at the field that names the set.
    r = await api.post("/v1/runs", json={**mapped, "dataset": {}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "prompts"], r.text
    assert r.json()["detail"][0]["msg"] == "the prompt file row 1 is not a prompt row: prompt: Field required"
    r = await api.post(
        "/v1/runs", json={**mapped, "prompts": str(data_dir / "train.parquet"), "eval": {"prompts": str(data_dir)}}
    )
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "eval", "prompts"], r.text
    r = await api.post("/v1/runs", json={**mapped, "dataset": {"prompt_key": "question", "extra": 1}})
    assert r.status_code == 422 and r.json()["detail"][0] == {
        "loc": ["body", "dataset"],
        "msg": "unknown field",
        "type": "extra_forbidden",
    }


async def test_the_openapi_document_offers_parquet_uploads(api: httpx.AsyncClient) -> None:
    operation = (await api.get("/openapi.json")).json()["paths"]["/v1/datasets"]["post"]
    assert set(operation["requestBody"]["content"]) == {"application/x-ndjson", PARQUET_MEDIA_TYPE}
    assert {p["name"] for p in operation["parameters"]} == {"prompt_key", "answer_key"}
