"""POST /v1/plan and `spotrl plan`: the same plan from both faces, behind a token, every input
bounded and finite, unknown fields refused, and no error that repeats what was sent."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from services.cli.main import app as cli
from services.control.api.auth import add_token
from tests.app_client import app_client

SEED_FILE = Path(__file__).parents[4] / "examples" / "plan-seed.yaml"
SEED = yaml.safe_load(SEED_FILE.read_text())
README = SEED_FILE.parents[1] / "README.md"
MARKER = "ZZsecretZZ"


@pytest.fixture
async def client(settings, tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    token = add_token(tmp_path / "tokens.json", tenant="acme")
    async with app_client(settings, tokens_file=tmp_path / "tokens.json") as api:
        yield api, {"Authorization": f"Bearer {token}"}


async def refused(client, body: dict | str, field: str, reason: str) -> list[dict]:
    api, auth = client
    content = body if isinstance(body, str) else json.dumps(body)
    r = await api.post("/v1/plan", content=content, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in map(str, d["loc"]) and reason in d["msg"] for d in detail), detail
    assert MARKER not in r.text and '"input"' not in r.text, r.text
    return detail


async def test_the_api_and_the_cli_give_the_seeds_plan(client) -> None:
    api, auth = client
    r = await api.post("/v1/plan", json=SEED, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["rollout"]["instances"], body["rollout"]["gpu"], body["training"]["gpus"]) == (4, "L20", 2)
    assert [t["amount"] for t in body["terms"]] == [40.0, 72.0, 112.0, 960.0]
    assert (body["cost_per_update"], body["always_on_per_update"], round(body["saving"], 4)) == (112.0, 960.0, 0.8833)

    result = CliRunner().invoke(cli, ["plan", str(SEED_FILE), "-o", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == body
    table = CliRunner().invoke(cli, ["plan", str(SEED_FILE)])
    assert table.exit_code == 0, table.output
    assert "CNY     112.00   CNY 40.00 + CNY 72.00" in table.output
    assert "88% less than always-on" in table.output
    assert table.output.strip() in README.read_text()  # the README shows this very output


async def test_the_plan_needs_a_token(client) -> None:
    api, _ = client
    for headers in ({}, {"Authorization": "Bearer srl_wrong"}):
        for body in (SEED, {"not": "a plan"}):  # nothing about the body is told before the token is checked
            assert (await api.post("/v1/plan", json=body, headers=headers)).status_code == 401


async def test_every_input_is_bounded_finite_and_known(client) -> None:
    await refused(client, {**SEED, "surprise": MARKER}, "body", "unknown field")
    await refused(client, {**SEED, "rollout": [{**SEED["rollout"][0], "colour": MARKER}]}, "rollout", "unknown field")
    await refused(
        client,
        json.dumps(SEED).replace('"samples_per_update": 12000', '"samples_per_update": 1e400'),
        "samples_per_update",
        "",
    )
    await refused(
        client, json.dumps(SEED).replace('"price_per_hour": 10', '"price_per_hour": NaN'), "price_per_hour", "finite"
    )
    await refused(client, {**SEED, "model_params": -1}, "model_params", "greater than or equal")
    await refused(client, {**SEED, "rollout": [SEED["rollout"][0]] * 33}, "rollout", "at most 32")
    await refused(
        client, {**SEED, "overheads": {"node_start_seconds": 1e9}}, "node_start_seconds", "less than or equal"
    )
    await refused(
        client,
        {**SEED, "training": [{**SEED["training"][0], "instance_type": MARKER * 10}]},
        "instance_type",
        "at most 64",
    )


async def test_a_plan_that_cannot_be_made_names_the_field_not_the_value(client) -> None:
    unknown = {**SEED["rollout"][0], "instance_type": f"ecs.{MARKER}", "price_per_hour": None}
    detail = await refused(client, {**SEED, "rollout": [unknown]}, "instance_type", "not in the price catalog")
    assert detail[0]["loc"] == ["body", "rollout", 0, "instance_type"]
    await refused(client, {**SEED, "currency": None}, "currency", "say their currency")

    bad = CliRunner().invoke(cli, ["plan", str(SEED_FILE.with_name("no-such-plan.yaml"))])
    assert bad.exit_code == 2 and "cannot read" in bad.output


async def test_the_openapi_document_describes_the_plan(client) -> None:
    api, _ = client
    doc = (await api.get("/openapi.json")).json()
    operation = doc["paths"]["/v1/plan"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/PlanRequest")
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/PlanPublic")
    assert {"400", "401", "413", "422"} <= set(operation["responses"])
    assert operation["security"] == [{"bearer": []}]
    plan = doc["components"]["schemas"]["PlanPublic"]
    assert {"cost_per_update", "cost_per_day", "always_on_per_update", "saving", "terms"} <= set(plan["required"])
    assert doc["components"]["schemas"]["PlanRequest"]["additionalProperties"] is False
