"""What a stranger may send the API: each defect found by trying it from outside is a case here.
No server file is read or leaked, every field is bounded and finite, no input gives a 500, and
large things are refused before they are read."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest

from services.control.api import service
from services.control.api.auth import NO_AUTH
from services.control.api.service import SpecFieldError, check_spec_for_server
from services.domain import prompts
from services.domain.names import tenant_object_key
from services.domain.prompt_items import PromptItem
from services.domain.prompts import MAX_LINE_CHARS, MAX_PROMPTS, InvalidPromptsError, JsonlParser, parse_jsonl, to_jsonl
from services.domain.runspec import RunSpec
from tests.app_client import app_client
from tests.iteration_rows import iteration_row

PROMPTS = [{"prompt": "What is 2 + 3?", "answer": "5"}]
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def spec(**changes) -> dict:
    return {"model": "tiny", "prompts": PROMPTS, "batch_samples": 8, "iterations": 2, **changes}


async def refused(api: httpx.AsyncClient, body: dict, field: str, reason: str) -> dict:
    r = await api.post("/v1/runs", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    json.loads(r.content, parse_constant=lambda c: pytest.fail(f"the response is not JSON: it holds {c}"))
    detail = r.json()["detail"]
    assert any(field in map(str, d["loc"]) and reason in d["msg"] for d in detail), detail
    return r.json()


@pytest.fixture
def server_files(tmp_path: Path) -> dict[str, Path]:
    """Files outside the data directory that no client may read, and a big one inside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    credentials = outside / "credentials.json"
    credentials.write_text(json.dumps({"aws_secret_access_key": SECRET}))
    return {"credentials": credentials, "missing": outside / "nothing-here.json", "dir": outside}


async def test_a_file_outside_the_data_dirs_is_neither_read_nor_told_apart(
    api: httpx.AsyncClient, server_files
) -> None:
    answers = []
    for name in ("credentials", "missing", "dir"):
        body = await refused(api, spec(prompts=str(server_files[name])), "prompts", "SPOTRL_DATA_DIRS")
        answers.append(body)
        assert SECRET not in json.dumps(body)
    assert answers[0] == answers[1] == answers[2]  # existence does not leak
    body = await refused(api, spec(prompts="/proc/sys/kernel/pid_max"), "prompts", "SPOTRL_DATA_DIRS")
    assert "input" not in json.dumps(body)
    await refused(api, spec(model=str(server_files["dir"])), "model", "SPOTRL_DATA_DIRS")
    await refused(api, spec(model="/etc"), "model", "SPOTRL_DATA_DIRS")


async def test_a_symlink_out_of_the_data_dir_is_refused(api: httpx.AsyncClient, tmp_path: Path, server_files) -> None:
    link = tmp_path / "data" / "innocent.jsonl"
    link.symlink_to(server_files["credentials"])
    body = await refused(api, spec(prompts=str(link)), "prompts", "SPOTRL_DATA_DIRS")
    assert SECRET not in json.dumps(body)


async def test_a_bad_line_of_a_data_file_is_named_without_its_content(api: httpx.AsyncClient, tmp_path: Path) -> None:
    f = tmp_path / "data" / "creds.jsonl"
    f.write_text(json.dumps({"aws_secret_access_key": SECRET}) + "\n")
    body = await refused(api, spec(prompts=str(f)), "prompts", "line 1")
    assert SECRET not in json.dumps(body)
    f.write_bytes(bytes(range(256)) * 4)  # a binary file
    await refused(api, spec(prompts=str(f)), "prompts", "not UTF-8")


async def test_a_file_over_the_limit_is_refused_unread(settings, tmp_path: Path) -> None:
    big = tmp_path / "data" / "big.jsonl"
    big.write_text('{"prompt": "x"}\n' * 10_000)  # 160 kB against a 64 kB limit
    async with app_client(settings, max_dataset_bytes=64 << 10) as api:
        await refused(api, spec(prompts=str(big)), "prompts", "larger than the 65536-byte limit")


@pytest.mark.parametrize(
    "uri", ["store://../../etc/passwd", "store:///x", "store://", "store://a//b", "store://./x", "store://a/../b"]
)
async def test_object_keys_that_escape_are_422(api: httpx.AsyncClient, uri: str) -> None:
    await refused(api, spec(prompts=uri), "prompts", "an object key is")


async def test_another_runs_prompts_are_not_reachable_through_store(api: httpx.AsyncClient) -> None:
    secret_prompts = [{"prompt": f"private {SECRET}", "answer": "1"}]
    other = (await api.post("/v1/runs", json=spec(prompts=secret_prompts))).json()["id"]
    body = await refused(api, spec(prompts=f"store://runs/{other}/prompts.jsonl"), "prompts", "no such object")
    assert SECRET not in json.dumps(body)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model": "/" + "m" * 300}, "model"),
        ({"prompts": "/" + "p" * 300}, "prompts"),
        ({"model": "/data/x\u0000y"}, "model"),
        ({"model": "/" + "m" * 2000}, "model"),
    ],
)
async def test_long_or_odd_paths_are_422_not_500(api: httpx.AsyncClient, changes: dict, field: str) -> None:
    r = await api.post("/v1/runs", json=spec(**changes))
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"][0]["loc"]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"training": {"learning_rate": 1e999}}', "learning_rate"),
        ('{"target_mean_reward": NaN, "iterations": null}', "target_mean_reward"),
        ('{"budget_dollars": 1e999}', "budget_dollars"),
        ('{"budget_dollars": Infinity}', "budget_dollars"),
        ('{"reward": [{"fn": "exact_match", "weight": -Infinity}]}', "weight"),
        ('{"batch_samples": 40000000}', "batch_samples"),
        ('{"batch_samples": 4e12}', "batch_samples"),
        ('{"iterations": 1e30}', "iterations"),
        ('{"rollout": {"min_workers": 1000, "max_workers": 1000}}', "max_workers"),
        ('{"training": {"processes": 64}}', "processes"),
        ('{"training": {"kl_coef": 1e300}}', "kl_coef"),
        ('{"sampling": {"max_new_tokens": 100000000}}', "max_new_tokens"),
        ('{"name": "' + "n" * 1000 + '"}', "name"),
        ('{"reward": [' + ", ".join(['{"fn": "exact_match"}'] * 17) + "]}", "reward"),
        ('{"rollout": {"instance_type": "' + "x" * 5000 + '"}}', "instance_type"),
    ],
)
async def test_every_number_is_finite_and_bounded(api: httpx.AsyncClient, raw: str, field: str) -> None:
    body = json.dumps(spec())[:-1] + ", " + raw[1:]  # the case's fields over the base spec's
    r = await api.post("/v1/runs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    json.loads(r.content, parse_constant=lambda c: pytest.fail(f"the response is not JSON: it holds {c}"))
    assert any(field in map(str, d["loc"]) for d in r.json()["detail"]), r.json()
    assert (await api.get("/v1/runs")).json()["runs"] == []


async def test_inline_prompts_are_bounded_and_not_echoed(api: httpx.AsyncClient) -> None:
    await refused(api, spec(prompts=[{"prompt": "p"}] * 10_001), "prompts", "at most 10000")
    many = [{"prompt": f"What is {i} + 1? " + "x" * 100, "answer": str(i + 1)} for i in range(10_000)]
    r = await api.post("/v1/runs", json=spec(prompts=many))
    assert r.status_code == 201, r.text
    got = await api.get(f"/v1/runs/{r.json()['id']}")
    assert (got.json()["spec"]["prompts"], got.json()["prompt_count"]) == ("inline", 10_000)
    assert len(got.content) < 10_000  # against ~1.3 MB of prompts
    # The set itself is kept beside the run, for the scheduler.
    stored = api.app.state.backends.objects.get_bytes(f"runs/{r.json()['id']}/prompts.jsonl")
    assert stored.count(b"\n") == 10_000


@pytest.mark.parametrize(
    ("section", "field", "setting", "reason"),
    [
        ("rollout", "max_workers", "max_rollout_workers", "at most 3 rollout workers per run"),
        ("training", "processes", "max_training_processes", "at most 3 training processes per job"),
        ("training", "nodes", "max_training_nodes", "at most 3 training nodes per job"),
    ],
)
async def test_the_operators_limits_are_422_naming_the_field(settings, section, field, setting, reason) -> None:
    async with app_client(settings, **{setting: 3}) as api:
        await refused(api, spec(**{section: {field: 4}}), field, reason)
        assert (await api.post("/v1/runs", json=spec(**{section: {field: 3}}))).status_code == 201


async def test_a_body_over_the_limit_is_refused_before_it_is_read(settings) -> None:
    big = json.dumps(spec(prompts=[{"prompt": "x" * 1000}] * 100)).encode()  # ~100 kB

    async def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    async with app_client(settings, max_body_bytes=64 << 10) as api:
        for content in (big, chunked()):
            r = await api.post("/v1/runs", content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 413, r.text
            assert "65536 bytes" in r.json()["detail"]
        assert (await api.get("/v1/runs")).json()["runs"] == []
        small = await api.post("/v1/runs", json=spec())
        assert small.status_code == 201


async def test_an_upload_over_its_limit_is_413_and_a_bad_upload_422(settings) -> None:
    async with app_client(settings, max_dataset_bytes=4096) as api:
        r = await api.post("/v1/datasets", content=b'{"prompt": "x"}\n' * 1000)
        assert r.status_code == 413
        r = await api.post("/v1/datasets", content=b'{"prompt": "x"}\n{"question": "y"}\n')
        assert (r.status_code, r.json()["detail"][0]["loc"]) == (422, ["body"])
        assert "line 2" in r.json()["detail"][0]["msg"]
        r = await api.post("/v1/datasets", content=b"\xff\xfe" * 100)
        assert r.status_code == 422


async def chunked(data: bytes, size: int):
    """``data`` in pieces of ``size`` bytes, with no Content-Length: counted as it arrives."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def test_an_upload_one_byte_over_its_limit_is_413_whether_it_says_its_length_or_not(settings) -> None:
    at_limit = b'{"prompt": "x"}\n' * 256  # 4096 bytes
    async with app_client(settings, max_dataset_bytes=4096) as api:
        for content in (at_limit + b"\n", chunked(at_limit + b"\n", 1000)):
            r = await api.post("/v1/datasets", content=content)
            assert r.status_code == 413, r.text
            assert "4096 bytes" in r.json()["detail"]
        for content in (at_limit, chunked(at_limit, 1000)):
            r = await api.post("/v1/datasets", content=content)
            assert (r.status_code, r.json()["prompts"], r.json()["bytes"]) == (201, 256, 4096), r.text


async def test_an_upload_is_refused_as_it_streams_without_the_body_limit_too(api: httpx.AsyncClient) -> None:
    """The route's own count and the parser stop reading, whatever the middleware in front does."""
    pulled = 0

    async def body(first: bytes):
        nonlocal pulled
        for piece in (first, *[b'{"prompt": "x"}\n' * 16384] * 40):  # then 40 pieces of 256 kB
            pulled += 1
            yield piece

    backends = api.app.state.backends  # type: ignore[attr-defined]
    with pytest.raises(service.BodyTooLargeError, match="limit of 300000 bytes"):
        await service.create_dataset(backends=backends, principal=NO_AUTH, body=body(b""), max_bytes=300_000)
    assert pulled == 3
    pulled = 0
    with pytest.raises(SpecFieldError, match="line 1 is not a"):
        await service.create_dataset(
            backends=backends, principal=NO_AUTH, body=body(b'{"question": "y"}\n'), max_bytes=64 << 20
        )
    assert pulled < 5  # refused at the first piece parsed, not after the 10 MB


def test_an_upload_parsed_piece_by_piece_is_the_file_parsed_whole() -> None:
    items = [
        PromptItem(prompt=p, answer=a)
        for p, a in [("What is 2 + 3?", "5"), ("caf\u00e9 \U0001f600", None), ("a\u2028b\x0cc", "\u00e9")]
    ]
    lines = to_jsonl(items).split(b"\n")
    data = b"\n".join(
        [lines[0], b"", b"  ", lines[1], b'  {"prompt": "spaced", "answer": "1"}  \r', lines[2]]
    )  # no final newline
    whole = parse_jsonl(data, "the upload")
    assert [i.prompt for i in whole] == ["What is 2 + 3?", "caf\u00e9 \U0001f600", "spaced", "a\u2028b\x0cc"]
    for size in (1, 2, 3, 5, 64, len(data)):  # pieces cut inside characters, lines and line ends
        parser = JsonlParser("the upload")
        for i in range(0, len(data), size):
            parser.feed(data[i : i + size])
        assert parser.finish() == whole, size
        assert parser.bytes_read == len(data)


async def test_an_uploaded_set_is_stored_as_the_set_parsed_whole(api: httpx.AsyncClient) -> None:
    data = b'{"prompt": "1+1", "answer": "2"}\n\n{"prompt": "caf\xc3\xa9"}\n' * 50
    r = await api.post("/v1/datasets", content=chunked(data, 7), headers={"Content-Type": "application/x-ndjson"})
    assert (r.status_code, r.json()["prompts"], r.json()["bytes"]) == (201, 100, len(data)), r.text
    stored = api.app.state.backends.objects.get_bytes(
        tenant_object_key(NO_AUTH.tenant, f"datasets/{r.json()['id']}.jsonl")
    )  # type: ignore[attr-defined]
    assert stored == to_jsonl(parse_jsonl(data, "the upload"))


def test_an_upload_is_refused_at_the_first_line_too_long_or_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = JsonlParser("the upload")
    parser.feed(b'{"prompt": "a"}\n{"prompt": "')
    with pytest.raises(InvalidPromptsError, match=f"line 2 is longer than {MAX_LINE_CHARS} characters"):
        parser.feed(b"x" * MAX_LINE_CHARS)  # refused before the line ends: only it is held
    monkeypatch.setattr(prompts, "MAX_PROMPTS", 3)
    parser = JsonlParser("the upload")
    parser.feed(b'{"prompt": "a"}\n\n')
    with pytest.raises(InvalidPromptsError, match="more than 3 lines"):
        parser.feed(b'\n{"prompt": "b"}\n')
    parser = JsonlParser("the upload")
    parser.feed(b'\n\n\n{"prompt": "d"}')  # a fourth line without its newline
    with pytest.raises(InvalidPromptsError, match="more than 3 lines"):
        parser.finish()


async def long_run(api: httpx.AsyncClient, *, iterations: int, pods: int) -> str:
    """A run whose store holds ``iterations`` iterations and a closed ledger entry per pod."""
    run_id = (await api.post("/v1/runs", json=spec(iterations=100_000))).json()["id"]
    state = api.app.state.backends.state  # type: ignore[attr-defined]
    for i in range(1, iterations + 1):
        state.record_iteration(
            iteration_row(
                run_id,
                i,
                mean_reward=i / iterations,
                kl=0.01,
                loss=0.5,
                seconds=2.0,
                metrics={"actor/pg_clipfrac": 0.1},
                ended_at=1000.0 + i,
            )
        )
    for i in range(pods):
        pod = f"{run_id}-rollout-{i}"
        state.open_ledger(
            run_id=run_id,
            role="rollout",
            pod=pod,
            instance_type="g6.xlarge",
            capacity_type="spot",
            price_per_hour=0.5,
            price_source="test",
            started_at=1000.0 + i,
        )
        state.close_ledger(pod, ended_at=1100.0 + i, outcome="succeeded")
    return run_id


async def test_a_long_run_is_read_with_its_latest_iterations_only(api: httpx.AsyncClient) -> None:
    run_id = await long_run(api, iterations=120, pods=0)
    got = await api.get(f"/v1/runs/{run_id}")
    run = got.json()
    assert ([it["iteration"] for it in run["iterations"]], run["iterations_total"]) == (list(range(21, 121)), 120)
    assert run["iterations_done"] == 120
    # Its size is that of the 100 shown, not of every iteration the run has (up to 100,000).
    every = await api.get(f"/v1/runs/{run_id}", params={"iterations_limit": 1000})
    assert len(every.json()["iterations"]) == 120
    assert len(got.content) < len(every.content) * 100 / 120 + 1000
    few = (await api.get(f"/v1/runs/{run_id}", params={"iterations_limit": 2})).json()
    assert ([it["iteration"] for it in few["iterations"]], few["iterations_total"]) == ([119, 120], 120)
    assert (await api.get(f"/v1/runs/{run_id}", params={"iterations_limit": 0})).json()["iterations"] == []
    assert (await api.get(f"/v1/runs/{run_id}", params={"iterations_limit": 1001})).status_code == 422
    cancelled = (await api.post(f"/v1/runs/{run_id}/cancel")).json()
    assert (len(cancelled["iterations"]), cancelled["iterations_total"]) == (100, 120)


async def test_a_long_runs_ledger_is_read_in_pages_and_its_totals_over_all_of_it(api: httpx.AsyncClient) -> None:
    run_id = await long_run(api, iterations=0, pods=120)
    first = (await api.get(f"/v1/runs/{run_id}/cost")).json()
    assert (len(first["entries"]), first["entries_total"]) == (100, 120)
    entries, cursor, pages = [], None, 0
    while True:
        params = {"limit": 50, **({"cursor": cursor} if cursor else {})}
        page = (await api.get(f"/v1/runs/{run_id}/cost", params=params)).json()
        assert (page["entries_total"], page["total_dollars"]) == (120, first["total_dollars"])
        entries += page["entries"]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert ([e["pod"] for e in entries], pages) == ([f"{run_id}-rollout-{i}" for i in range(120)], 3)
    assert first["total_dollars"] == pytest.approx(sum(e["dollars"] for e in entries))
    assert first["by_role"]["rollout"] == pytest.approx(first["total_dollars"])
    runs_cursor = base64.urlsafe_b64encode(
        json.dumps([1000.0, run_id]).encode()
    ).decode()  # GET /v1/runs's, not this one's
    for forged in ("not-a-cursor", runs_cursor, base64.urlsafe_b64encode(b'["ledger", true]').decode()):
        assert (await api.get(f"/v1/runs/{run_id}/cost", params={"cursor": forged})).status_code == 400, forged
    assert (await api.get(f"/v1/runs/{run_id}/cost", params={"limit": 1001})).status_code == 422


async def test_runs_are_listed_in_pages(api: httpx.AsyncClient) -> None:
    ids = [(await api.post("/v1/runs", json=spec(name=f"r{i}"))).json()["id"] for i in range(5)]
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (await api.get("/v1/runs", params=params)).json()
        seen += [r["id"] for r in page["runs"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert (seen, pages) == (ids, 3)
    for forged in (
        "not-a-cursor",
        *(base64.urlsafe_b64encode(f'[{t}, "run-0"]'.encode()).decode() for t in ("NaN", "-Infinity", "true")),
    ):
        assert (await api.get("/v1/runs", params={"cursor": forged})).status_code == 400, forged
    assert (await api.get("/v1/runs", params={"limit": 100_000})).status_code == 422


async def test_the_openapi_document_tells_what_each_operation_returns(api: httpx.AsyncClient) -> None:
    doc = (await api.get("/openapi.json")).json()
    paths = doc["paths"]
    assert "404" in paths["/v1/runs/{run_id}"]["get"]["responses"]
    assert {"404", "409"} <= paths["/v1/runs/{run_id}/cancel"]["post"]["responses"].keys()
    assert "400" in paths["/v1/runs"]["get"]["responses"]
    assert "413" in paths["/v1/runs"]["post"]["responses"]
    assert "401" in paths["/v1/runs"]["post"]["responses"]
    for path in ("/readyz", "/metrics"):
        assert "application/json" not in paths[path]["get"]["responses"]["200"]["content"], path
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "A token the operator issued with `spotrl token add`.",
    }
    assert {"bearer": []} in paths["/v1/runs"]["post"]["security"]
    assert "application/x-ndjson" in paths["/v1/datasets"]["post"]["requestBody"]["content"]
    assert (await api.get("/readyz")).headers["content-type"].startswith("text/plain")
    # The media type sent is the one documented (prometheus_client's, with its version).
    metrics = await api.get("/metrics")
    assert [metrics.headers["content-type"]] == list(paths["/metrics"]["get"]["responses"]["200"]["content"])


def test_a_prompt_set_is_counted_in_lines_before_it_is_read_and_split_at_newlines_only() -> None:
    with pytest.raises(InvalidPromptsError, match=f"more than {MAX_PROMPTS} lines"):
        parse_jsonl(b"\n" * (MAX_PROMPTS + 1), "the upload")  # blank: it once took a minute to find none
    assert len(parse_jsonl(b'{"prompt": "x"}\n' * 3, "the upload")) == 3
    odd = ["a\u2028b", "c\x0cd", "e\x1df\x85"]  # str.splitlines would cut each of these
    assert [p.prompt for p in parse_jsonl(to_jsonl([PromptItem(prompt=o) for o in odd]), "the upload")] == odd


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://spotrl-reward.ml.svc:8100", True),
        ("http://SPOTRL-reward.ml.svc:8100/v1/", True),
        ("http://spotrl-reward.ml.svc:8100@metadata.internal/", False),  # userinfo: the host is metadata.internal
        ("http://spotrl-reward.ml.svc:8100\\@metadata.internal/", False),
        ("http://spotrl-reward.ml.svc:8100.metadata.internal/", False),
        ("http://spotrl-reward.ml.svc:81000/", False),
        ("https://spotrl-reward.ml.svc:8100/", False),
        ("http://spotrl-reward.ml.svc:notaport/", False),
    ],
)
def test_a_reward_service_url_is_compared_parsed_not_as_text(settings, url: str, allowed: bool) -> None:
    run = RunSpec.model_validate(spec(reward=[{"fn": "reward_model", "url": url}]))
    operator = settings.model_copy(update={"reward_service_urls": "http://spotrl-reward.ml.svc:8100"})
    if allowed:
        check_spec_for_server(run, operator)
    else:
        with pytest.raises(SpecFieldError, match="SPOTRL_REWARD_SERVICE_URLS"):
            check_spec_for_server(run, operator)
