"""Tenants: a token sees its tenant's runs and objects only, an admin token sees all, and no
token appears anywhere but in the caller's own header."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from services.cli.main import app as cli
from services.control.api.auth import TokenBook, TokensFileError, add_token, hash_token
from services.domain.names import pod_log_key
from tests.app_client import app_client

SPEC = {"model": "tiny", "prompts": [{"prompt": "What is 2 + 3?", "answer": "5"}], "batch_samples": 8, "iterations": 2}
DATASET = b'{"prompt": "1+1", "answer": "2"}\n'


@pytest.fixture
def tokens(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "tokens.json"
    return {
        "file": str(path),
        "acme": add_token(path, tenant="acme"),
        "globex": add_token(path, tenant="globex"),
        "admin": add_token(path, tenant="ops", admin=True),
    }


@pytest.fixture
async def client(settings, tokens) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(settings, tokens_file=Path(tokens["file"])) as c:
        yield c


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_the_file_holds_hashes_only(tokens) -> None:
    text = Path(tokens["file"]).read_text()
    assert Path(tokens["file"]).stat().st_mode & 0o777 == 0o600
    for who in ("acme", "globex", "admin"):
        assert tokens[who] not in text
        assert hash_token(tokens[who]) in text
    assert {e["tenant"] for e in json.loads(text)["tokens"]} == {"acme", "globex", "ops"}


OPEN = ("/healthz", "/readyz", "/openapi.json", "/docs")
PLACEHOLDERS = {"run_id": "run-0123456789", "pod": "run-0123456789-train-1"}


def _operations(app) -> list[tuple[str, str]]:
    """Every (method, path) the OpenAPI document lists, path parameters filled in: a new route is
    covered without being named here."""
    return [
        (method.upper(), path.format(**PLACEHOLDERS))
        for path, item in app.openapi()["paths"].items()
        for method in item
        if path not in OPEN
    ]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer srl_wrong"}, {"Authorization": "Basic YTpi"}])
async def test_every_route_but_health_and_docs_needs_a_token(client: httpx.AsyncClient, headers: dict) -> None:
    operations = _operations(client.app)
    assert {("POST", "/v1/runs"), ("POST", "/v1/plan"), ("GET", "/metrics")} <= set(operations)
    for method, path in operations:
        r = await client.request(method, path, headers=headers, json=SPEC if path == "/v1/runs" else None)
        assert r.status_code == 401, (method, path, r.text)
        assert r.headers["www-authenticate"] == 'Bearer realm="spotrl"'
    for path in OPEN:
        assert (await client.get(path, headers=headers)).status_code == 200, path


async def test_a_tenant_sees_its_own_runs_only(client: httpx.AsyncClient, tokens) -> None:
    acme = (await client.post("/v1/runs", json=SPEC, headers=auth(tokens["acme"]))).json()
    globex = (await client.post("/v1/runs", json=SPEC, headers=auth(tokens["globex"]))).json()
    assert (acme["tenant"], globex["tenant"]) == ("acme", "globex")

    pod = f"{acme['id']}-train-1"
    client.app.state.backends.objects.put_bytes(
        pod_log_key(acme["id"], pod), b"loss 0.1\n"
    )  # as the scheduler keeps it
    for path in (
        f"/v1/runs/{acme['id']}",
        f"/v1/runs/{acme['id']}/cost",
        f"/v1/runs/{acme['id']}/pods",
        f"/v1/runs/{acme['id']}/pods/{pod}/logs",
        f"/v1/runs/{acme['id']}/report",
    ):
        mine = await client.get(path, headers=auth(tokens["acme"]))
        theirs = await client.get(path, headers=auth(tokens["globex"]))
        nobody = await client.get(path.replace(acme["id"], "run-0123456789"), headers=auth(tokens["globex"]))
        assert (mine.status_code, theirs.status_code) == (200, 404), path
        assert theirs.json() == nobody.json()  # another tenant's run is as absent as a run that never was
        assert (await client.get(path, headers=auth(tokens["admin"]))).content == mine.content
    r = await client.post(f"/v1/runs/{acme['id']}/cancel", headers=auth(tokens["globex"]))
    assert r.status_code == 404
    assert (await client.get(f"/v1/runs/{acme['id']}", headers=auth(tokens["acme"]))).json()["status"] == "PENDING"

    listed = {
        who: [r["id"] for r in (await client.get("/v1/runs", headers=auth(tokens[who]))).json()["runs"]]
        for who in ("acme", "globex", "admin")
    }
    assert listed == {"acme": [acme["id"]], "globex": [globex["id"]], "admin": [acme["id"], globex["id"]]}
    # An admin reads and cancels any tenant's run.
    assert (await client.get(f"/v1/runs/{acme['id']}/cost", headers=auth(tokens["admin"]))).status_code == 200
    r = await client.post(f"/v1/runs/{acme['id']}/cancel", headers=auth(tokens["admin"]))
    assert (r.status_code, r.json()["status"]) == (200, "CANCELLING")


async def test_a_tenant_reaches_its_own_datasets_only(client: httpx.AsyncClient, tokens) -> None:
    uri = (await client.post("/v1/datasets", content=DATASET, headers=auth(tokens["acme"]))).json()["uri"]
    mine = await client.post("/v1/runs", json={**SPEC, "prompts": uri}, headers=auth(tokens["acme"]))
    theirs = await client.post("/v1/runs", json={**SPEC, "prompts": uri}, headers=auth(tokens["globex"]))
    assert (mine.status_code, theirs.status_code) == (201, 422)
    assert "no such object" in theirs.json()["detail"][0]["msg"]


async def test_metrics_are_for_admins_and_carry_no_prompts(client: httpx.AsyncClient, tokens) -> None:
    secret_prompt = "the merger closes on friday"
    await client.post("/v1/runs", json={**SPEC, "prompts": [{"prompt": secret_prompt}]}, headers=auth(tokens["acme"]))
    assert (await client.get("/metrics", headers=auth(tokens["acme"]))).status_code == 403
    text = (await client.get("/metrics", headers=auth(tokens["admin"]))).text
    assert 'spotrl_runs{status="PENDING"} 1.0' in text
    assert secret_prompt not in text


async def test_no_token_is_logged_or_echoed(
    client: httpx.AsyncClient, tokens, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seen = []
    for token in (tokens["acme"], tokens["acme"] + "x", "srl_" + "y" * 43):
        for r in (
            await client.get("/v1/runs", headers=auth(token)),
            await client.post("/v1/runs", json={**SPEC, "iterations": 0}, headers=auth(token)),
            await client.get("/metrics", headers=auth(token)),
        ):
            seen.append(r.text + json.dumps(dict(r.headers)))
        seen.append((await client.get("/metrics", headers=auth(tokens["admin"]))).text)
        for text in seen + [caplog.text]:
            assert token not in text
            assert tokens["admin"] not in text


def test_a_bad_tokens_file_says_what_to_fix_without_its_content(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text('{"tokens": [{"sha256": "srl_plaintext_token_by_mistake", "tenant": "acme"}]}')
    with pytest.raises(TokensFileError, match="entry 1 .* no sha256 of 64 hex digits") as e:
        TokenBook(path)
    assert "srl_plaintext_token_by_mistake" not in str(e.value)
    path.write_text(json.dumps({"tokens": [{"sha256": "0" * 64, "tenant": "Not A Tenant!"}]}))
    with pytest.raises(TokensFileError, match="not a tenant name"):
        TokenBook(path)


async def test_a_token_added_to_the_file_works_without_a_restart(client: httpx.AsyncClient, tokens) -> None:
    late = add_token(Path(tokens["file"]), tenant="initech")
    r = await client.post("/v1/runs", json=SPEC, headers=auth(late))
    assert (r.status_code, r.json()["tenant"]) == (201, "initech")


def test_serve_refuses_to_listen_beyond_loopback_without_tokens(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0", "--home", str(tmp_path / "home")])
    assert result.exit_code == 2
    assert "without tokens" in result.output and "--insecure-no-auth" in result.output


def test_token_add_prints_the_token_once(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    result = CliRunner().invoke(cli, ["token", "add", "--tenant", "acme", "--file", str(path)])
    assert result.exit_code == 0, result.output
    token = result.output.strip()
    assert TokenBook(path).principal(token).tenant == "acme"
    assert token not in path.read_text()


async def _refused_everywhere(client: httpx.AsyncClient, tokens) -> None:
    for who in ("acme", "admin"):
        for method, path in (("GET", "/v1/runs"), ("GET", "/metrics"), ("POST", "/v1/plan")):
            r = await client.request(method, path, headers=auth(tokens[who]), json={})
            assert r.status_code == 401, (who, method, path, r.text)
            assert r.headers["www-authenticate"] == 'Bearer realm="spotrl"'
    r = await client.get("/readyz")
    assert r.status_code == 503 and "tokens file" in r.text
    assert tokens["file"] not in r.text  # /readyz is open: it does not name the file


@pytest.mark.parametrize("damage", ["delete", "not json", "plaintext token"])
async def test_a_missing_or_invalid_tokens_file_refuses_every_token_until_it_is_back(
    client: httpx.AsyncClient, tokens, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    path = Path(tokens["file"])
    good = path.read_bytes()
    assert (await client.get("/v1/runs", headers=auth(tokens["acme"]))).status_code == 200
    assert (await client.get("/readyz")).status_code == 200
    caplog.set_level(logging.INFO, logger="services.control.api.auth")

    secret = "srl_plaintext_token_by_mistake"
    if damage == "delete":
        path.unlink()
    elif damage == "not json":
        path.write_text('{"tokens": [' + secret)
    else:
        path.write_text(json.dumps({"tokens": [{"sha256": secret, "tenant": "acme"}]}))
    await _refused_everywhere(client, tokens)
    await _refused_everywhere(client, tokens)  # still refused, and logged once, not per request
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert tokens["file"] in errors[0].getMessage()
    assert secret not in caplog.text and hash_token(tokens["acme"]) not in caplog.text

    path.write_bytes(good)  # a valid file again: no restart needed
    r = await client.get("/v1/runs", headers=auth(tokens["acme"]))
    assert r.status_code == 200, r.text
    assert (await client.get("/metrics", headers=auth(tokens["admin"]))).status_code == 200
    assert (await client.get("/readyz")).status_code == 200
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


async def test_each_change_to_a_still_invalid_file_is_logged_once(
    client: httpx.AsyncClient, tokens, caplog: pytest.LogCaptureFixture
) -> None:
    path = Path(tokens["file"])
    caplog.set_level(logging.ERROR, logger="services.control.api.auth")
    path.unlink()
    await _refused_everywhere(client, tokens)
    path.write_text("not json")
    await _refused_everywhere(client, tokens)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(messages) == 2 and "cannot read" in messages[0] and "not JSON" in messages[1], messages
