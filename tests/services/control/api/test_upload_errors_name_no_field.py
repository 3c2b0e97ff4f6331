"""An upload's row errors name the row and the kind of error, and a field only by a name the
server gives it: a field's name in the file is the client's content, never sent back."""

from __future__ import annotations

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from services.domain.prompts import PARQUET_MEDIA_TYPE
from tests.services.domain.verl_rows import gsm8k_rows, jsonl, parquet

EVIL = "<script>evil"


def refusal(response: httpx.Response) -> str:
    assert response.status_code == 422, response.text
    return response.json()["detail"][0]["msg"]


async def test_an_unknown_field_of_a_chat_message_is_refused_without_its_name(api: httpx.AsyncClient) -> None:
    rows = gsm8k_rows(3)
    rows[1]["prompt"] = [{"role": "user", "content": "1+1?", EVIL: "x"}]
    for data, media_type, row in (
        (jsonl(rows), "application/x-ndjson", "line 2"),
        (parquet(rows), PARQUET_MEDIA_TYPE, "row 2"),
    ):
        r = await api.post("/v1/datasets", content=data, headers={"Content-Type": media_type})
        assert (
            refusal(r)
            == f"the upload {row} is not a prompt row: prompt.0.(field 3): unknown field; remove it from the file"
        )
        assert "script" not in r.text and "evil" not in r.text


async def test_a_column_of_no_json_type_is_refused_by_its_position(api: httpx.AsyncClient) -> None:
    table = pa.table({"prompt": ["a", "b"], EVIL: pa.array([1, 2], pa.timestamp("s"))})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    r = await api.post(
        "/v1/datasets", content=sink.getvalue().to_pybytes(), headers={"Content-Type": PARQUET_MEDIA_TYPE}
    )
    assert refusal(r) == "the upload row 1 is not a prompt row: (field 2): input was not a valid JSON value"
    assert "script" not in r.text and "evil" not in r.text


async def test_fields_the_server_names_are_named(api: httpx.AsyncClient) -> None:
    rows = gsm8k_rows(2)
    rows[1]["prompt"] = [{"role": "robot", "content": "1+1?"}]
    assert "the upload line 2 is not a prompt row: prompt.0.role: Input should be" in refusal(
        await api.post("/v1/datasets", content=jsonl(rows), headers={"Content-Type": "application/x-ndjson"})
    )
