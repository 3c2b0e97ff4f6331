"""A run spec sent over the API is read strictly: a boolean or a string is no number, a number no
string; enums are their JSON strings and an integer stands for a float."""

from __future__ import annotations

import httpx
import pytest

PROMPTS = [{"prompt": "What is 2 + 3?", "answer": "5"}]


def spec(**changes) -> dict:
    return {"model": "tiny", "prompts": PROMPTS, "batch_samples": 8, "iterations": 2, **changes}


@pytest.mark.parametrize(
    ("changes", "loc", "kind"),
    [
        ({"iterations": True}, ["body", "iterations"], "int_type"),
        ({"iterations": "3"}, ["body", "iterations"], "int_type"),
        ({"iterations": 3.5}, ["body", "iterations"], "int_type"),
        ({"training": {"learning_rate": "1e-5"}}, ["body", "training", "learning_rate"], "float_type"),
        ({"rollout": {"spot": 1}}, ["body", "rollout", "spot"], "bool_type"),
        ({"name": 7}, ["body", "name"], "string_type"),
    ],
)
async def test_a_value_of_the_wrong_json_type_is_422_naming_the_field(
    api: httpx.AsyncClient, changes: dict, loc: list, kind: str
) -> None:
    r = await api.post("/v1/runs", json=spec(**changes))
    assert r.status_code == 422, r.text
    assert {"loc": loc, "type": kind} in [{"loc": d["loc"], "type": d["type"]} for d in r.json()["detail"]]
    assert (await api.get("/v1/runs")).json()["runs"] == []


async def test_enums_as_strings_and_integers_for_floats_are_accepted(api: httpx.AsyncClient) -> None:
    r = await api.post(
        "/v1/runs",
        json=spec(
            algorithm="grpo",
            cost_policy="threshold",
            rollout={"engine": "hf", "min_workers": 0},
            reward=[{"fn": "exact_match", "weight": 2}],
            training={"learning_rate": 1, "loss_agg": "seq-mean-token-mean"},
            sampling={"temperature": 1, "top_p": 1},
            budget_dollars=5,
        ),
    )
    assert r.status_code == 201, r.text
    got = r.json()["spec"]
    assert (got["cost_policy"], got["training"]["learning_rate"], got["reward"][0]["weight"]) == ("threshold", 1.0, 2.0)
    # A stored spec reads back as it was stored.
    assert (await api.get(f"/v1/runs/{r.json()['id']}")).json()["spec"] == got
