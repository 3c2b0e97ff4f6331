"""What the API builds from a request's Host header (nothing), and the /docs page, which loads
its assets from the API itself and names no other origin."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.app_client import app_client

HOSTILE = "attacker.example"
PLACEHOLDERS = {"run_id": "run-0123456789", "pod": "run-0123456789-train-1"}


@pytest.fixture
async def client(settings) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(settings) as c:
        yield c


async def test_no_response_carries_a_hostile_host(client: httpx.AsyncClient) -> None:
    paths = [path.format(**PLACEHOLDERS) for path in client.app.openapi()["paths"]] + ["/docs"]
    assert "/v1/runs" in paths
    for path in paths:
        for variant in (path + "/", path.rstrip("/"), path + "//"):
            for method in ("GET", "POST"):
                r = await client.request(method, variant, headers={"Host": HOSTILE})
                assert not 300 <= r.status_code < 400, (method, variant, r.status_code, r.headers)
                assert HOSTILE not in r.text and HOSTILE not in repr(r.headers.raw), (method, variant)


async def test_the_trailing_slash_path_is_not_found_rather_than_redirected(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/runs/", headers={"Host": HOSTILE})
    assert (r.status_code, "location" in r.headers) == (404, False)
    assert (await client.get("/v1/runs")).status_code == 200


ORIGIN = re.compile(r"\b(?:https?:)?//[A-Za-z0-9.-]+(?::\d+)?", re.IGNORECASE)


async def test_docs_load_from_the_api_itself(client: httpx.AsyncClient) -> None:
    r = await client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert ORIGIN.findall(r.text) == []  # every URL of the page is a path on this server
    assert "SwaggerUIBundle" in r.text
    assert '"validatorUrl": null' in r.text  # the UI sends the document to no online validator
    urls = re.findall(r'(?:src|href)="([^"]+)"', r.text) + re.findall(r"url: '([^']+)'", r.text)
    assert len(urls) == 4 and all(u.startswith("/") for u in urls), urls
    for url in urls:
        asset = await client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 100, url
    js = next(u for u in urls if u.endswith(".js"))
    assert (await client.get(js)).headers["content-type"].startswith("text/javascript")


@pytest.mark.parametrize(
    "path",
    ["/redoc", "/docs/assets/index.html", "/docs/assets/swagger-initializer.js", "/docs/assets/..%2Fswagger-ui.css"],
)
async def test_no_other_docs_page_or_file_is_served(client: httpx.AsyncClient, path: str) -> None:
    # ReDoc's page and Swagger UI's sample page load scripts and documents from other origins.
    assert (await client.get(path)).status_code == 404


async def test_the_openapi_document_is_still_served(client: httpx.AsyncClient) -> None:
    r = await client.get("/openapi.json")
    assert r.status_code == 200 and "/v1/runs" in r.json()["paths"]
    assert not any(path.startswith("/docs") for path in r.json()["paths"])
