"""`spotrl runs submit` uploads the local prompt files a spec names, Parquet and JSONL, with the
spec's field mapping, against the API app in process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from starlette.testclient import TestClient

from services.client.api import ApiClient, ApiError, Target, read_spec_file, upload_local_prompts
from services.control.api.main import create_app
from services.domain.names import eval_prompts_key, prompts_key
from services.domain.prompts import parse_jsonl
from tests.services.domain.verl_rows import gsm8k_rows, jsonl, parquet


@pytest.fixture
def client_and_app(settings) -> Iterator[tuple[ApiClient, TestClient]]:
    with TestClient(create_app(settings, with_scheduler=False), base_url="http://spotrl") as app:

        def to_app(request: httpx.Request) -> httpx.Response:  # the client's requests, to the app in this process
            r = app.request(request.method, str(request.url), headers=dict(request.headers), content=request.read())
            return httpx.Response(r.status_code, headers=list(r.headers.items()), content=r.content)

        with ApiClient(Target("http://spotrl", None), transport=httpx.MockTransport(to_app)) as client:
            yield client, app


def write_spec(folder: Path, **fields) -> Path:
    spec = {"model": "tiny", "batch_samples": 8, "iterations": 2, **fields}
    (folder / "run.yaml").write_text(yaml.safe_dump(spec))
    return folder / "run.yaml"


def test_a_local_parquet_in_verls_layout_and_its_held_out_set_are_uploaded(client_and_app, tmp_path: Path) -> None:
    client, app = client_and_app
    laptop = tmp_path / "laptop"
    (laptop / "prepared").mkdir(parents=True)
    parquet(gsm8k_rows(40), laptop / "prepared" / "train.parquet")
    parquet(gsm8k_rows(6, split="test"), laptop / "prepared" / "test.parquet")
    spec_file = write_spec(laptop, prompts="prepared/train.parquet", eval={"prompts": "prepared/test.parquet"})
    spec = read_spec_file(spec_file)
    uploaded = upload_local_prompts(client, spec, base_dir=spec_file.parent)
    assert uploaded is not None and uploaded["prompts"] == 40
    assert spec["prompts"].startswith("store://datasets/") and spec["eval"]["prompts"].startswith("store://datasets/")
    run = client.submit(spec)
    objects = app.app.state.backends.objects
    prompts = parse_jsonl(objects.get_bytes(prompts_key(run["id"])), "the run's set")
    held_out = parse_jsonl(objects.get_bytes(eval_prompts_key(run["id"])), "the held-out set")
    assert run["prompt_count"] == 40 and [p.answer for p in prompts[:3]] == ["6", "9", "12"]
    assert len(held_out) == 6 and {h.extra_info["split"] for h in held_out} == {"test"}


def test_the_specs_field_mapping_goes_with_each_upload(client_and_app, tmp_path: Path) -> None:
    client, app = client_and_app
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    rows = [{"question": f"{i} + 1?", "solution": {"final": str(i + 1)}} for i in range(4)]
    parquet(rows, laptop / "train.parquet")
    (laptop / "test.jsonl").write_bytes(jsonl(rows[:2]))
    spec_file = write_spec(laptop, prompts="train.parquet", eval={"prompts": "test.jsonl"})
    with pytest.raises(ApiError) as refused:  # unmapped, the rows hold no `prompt`
        upload_local_prompts(client, read_spec_file(spec_file), base_dir=laptop)
    assert refused.value.status == 422 and "row 1 is not a prompt row: prompt: Field required" in str(refused.value)
    spec_file = write_spec(
        laptop,
        prompts="train.parquet",
        eval={"prompts": "test.jsonl"},
        dataset={"prompt_key": "question", "answer_key": "solution.final"},
    )
    spec = read_spec_file(spec_file)
    upload_local_prompts(client, spec, base_dir=laptop)
    run = client.submit(spec)
    objects = app.app.state.backends.objects
    prompts = parse_jsonl(objects.get_bytes(prompts_key(run["id"])), "the run's set")
    held_out = parse_jsonl(objects.get_bytes(eval_prompts_key(run["id"])), "the held-out set")
    assert [(p.prompt, p.answer) for p in prompts] == [(f"{i} + 1?", str(i + 1)) for i in range(4)]
    assert [(h.prompt, h.answer) for h in held_out] == [("0 + 1?", "1"), ("1 + 1?", "2")]


def test_a_yaml_spec_reads_exponent_numbers_as_numbers_and_is_accepted(client_and_app, tmp_path: Path) -> None:
    client, _ = client_and_app
    (tmp_path / "run.yaml").write_text(
        "model: tiny\nbatch_samples: 8\niterations: 2\nprompts: [{prompt: a, answer: '1'}]\n"
        "training: {learning_rate: 1e-5, max_grad_norm: 1E3, clip_ratio: 2.5e-1}\nname: 1e-5x\n"
    )
    spec = read_spec_file(tmp_path / "run.yaml")
    assert spec["training"] == {"learning_rate": 1e-5, "max_grad_norm": 1000.0, "clip_ratio": 0.25}
    assert (spec["iterations"], spec["name"]) == (2, "1e-5x")  # integers stay integers, text text
    run = client.submit(spec)  # the API reads it strictly: a string would be refused where a number belongs
    assert run["spec"]["training"]["learning_rate"] == 1e-5
