"""A refusal names the field that is wrong, never the text the client sent in its place: not an
unknown store key, not an unknown field's name."""

from __future__ import annotations

import httpx
import pytest

SECRET = "SECRET-CLIENT-TEXT"
PROMPTS = [{"prompt": "What is 2 + 3?", "answer": "5"}]


def spec(**changes) -> dict:
    return {"model": "tiny", "prompts": PROMPTS, "batch_samples": 8, "iterations": 2, **changes}


@pytest.mark.parametrize("where", ["prompts", "eval"])
async def test_an_unknown_store_key_is_not_repeated(api: httpx.AsyncClient, where: str) -> None:
    key = f"store://datasets/{SECRET}/{'x' * 120}/{SECRET}.jsonl"  # a well-formed key that names nothing
    body = spec(prompts=key) if where == "prompts" else spec(eval={"prompts": key})
    r = await api.post("/v1/runs", json=body)
    assert r.status_code == 422, r.text
    (d,) = r.json()["detail"]
    assert d["loc"] == (["body", "prompts"] if where == "prompts" else ["body", "eval", "prompts"])
    assert "no such object among this tenant's objects" in d["msg"]
    assert SECRET not in r.text and "x" * 20 not in r.text


@pytest.mark.parametrize(
    ("changes", "loc"),
    [
        ({SECRET: 1}, ["body"]),
        ({"training": {SECRET: 1}}, ["body", "training"]),
        ({"reward": [{"fn": "exact_match", SECRET: 1}]}, ["body", "reward", 0]),
        ({"prompts": [{"prompt": "a", "answer": "1", SECRET: 1}]}, ["body", "prompts", "list[PromptItem]", 0]),
        ({"eval": {"prompts": PROMPTS, f"{SECRET}<script>" * 20: 1}}, ["body", "eval"]),
    ],
)
async def test_an_unknown_field_is_named_by_the_model_that_holds_it(
    api: httpx.AsyncClient, changes: dict, loc: list
) -> None:
    r = await api.post("/v1/runs", json=spec(**changes))
    assert r.status_code == 422, r.text
    unknown = [d for d in r.json()["detail"] if d["type"] == "extra_forbidden"]
    assert [(d["loc"], d["msg"]) for d in unknown] == [(loc, "unknown field")], r.json()["detail"]
    assert SECRET not in r.text
    assert (await api.get("/v1/runs")).json()["runs"] == []


async def test_a_misplaced_declared_field_is_still_refused_by_name(api: httpx.AsyncClient) -> None:
    # training.temperature is the run's sampling.temperature: a declared name, told as such.
    r = await api.post("/v1/runs", json=spec(training={"temperature": 0.5}))
    assert r.status_code == 422, r.text
    assert "sampling.temperature" in r.text


async def test_an_unknown_eval_metric_is_named_by_its_place(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/runs", json=spec(eval={"prompts": PROMPTS, "metrics": ["mean", SECRET]}))
    assert r.status_code == 422, r.text
    assert "metrics[1] is neither" in r.text and SECRET not in r.text
