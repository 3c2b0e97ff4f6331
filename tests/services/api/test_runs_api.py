"""The REST API's contract: valid specs are stored, bad input is refused with the field and the reason."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from contracts.status import RunStatus
from services.backends.launcher import PodSpec
from services.scheduler.loop import Scheduler

PROMPTS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is 1 + 1?", "answer": "2"}]


def spec(**changes) -> dict:
    base = {"model": "tiny", "prompts": PROMPTS, "batch_samples": 8, "iterations": 2}
    base.update(changes)
    return base


async def test_submit_get_list(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/runs", json=spec(name="first"))
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["status"] == "PENDING"
    assert run["id"].startswith("run-")
    assert run["spec"]["batch_samples"] == 8
    assert run["spec"]["rollout"] == {"instance_type": "g6.xlarge", "spot": True, "min_workers": 2, "max_workers": 10,
                                      "prompts_per_batch": 8, "engine": "hf"}
    got = (await api.get(f"/v1/runs/{run['id']}")).json()
    assert got["name"] == "first"
    assert got["samples"] == {"produced": 0, "trained": 0, "dropped": 0}
    assert [x["id"] for x in (await api.get("/v1/runs")).json()["runs"]] == [run["id"]]


async def test_prompts_from_jsonl_file(api: httpx.AsyncClient, tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
    assert (await api.post("/v1/runs", json=spec(prompts=str(f)))).status_code == 201


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"model": "gpt-17"}, "model", "smollm2-135m"),
        ({"algorithm": "dpo"}, "algorithm", "grpo"),
        ({"iterations": None}, "body", "target_mean_reward"),
        ({"batch_samples": 7}, "body", "multiple of samples_per_prompt"),
        ({"samples_per_prompt": 1}, "body", "grpo needs samples_per_prompt >= 2"),
        ({"rollout": {"min_workers": 5, "max_workers": 2}}, "rollout", "exceeds max_workers"),
        ({"rollout": {"instance_type": "x9.huge"}}, "instance_type", "g6.xlarge"),
        ({"reward": [{"fn": "regex"}]}, "reward", "needs `pattern`"),
        ({"reward": [{"fn": "regex", "pattern": "("}]}, "reward", "not a valid regular expression"),
        ({"prompts": []}, "prompts", "at least one prompt"),
        ({"prompts": "/nonexistent/prompts.jsonl"}, "prompts", "does not exist"),
        ({"sampling": {"temperature": -1}}, "temperature", "greater than or equal"),
        ({"budget_dollars": 0}, "budget_dollars", "greater than 0"),
        ({"surprise": 1}, "surprise", "Extra inputs"),
        ({"algorithm": "ppo", "training": {"adv_estimator": "rloo"}}, "body", "ppo uses gae"),
        ({"training": {"adv_estimator": "magic"}}, "adv_estimator", "rloo"),
    ],
)
async def test_invalid_spec_is_422_and_changes_nothing(api: httpx.AsyncClient, changes: dict, field: str, reason: str) -> None:
    r = await api.post("/v1/runs", json=spec(**changes))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in map(str, d["loc"]) and reason in d["msg"] for d in detail), detail
    assert (await api.get("/v1/runs")).json()["runs"] == []


async def test_bad_jsonl_line_is_named(api: httpx.AsyncClient, tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    r = await api.post("/v1/runs", json=spec(prompts=str(f)))
    assert r.status_code == 422
    assert "line 2" in r.json()["detail"][0]["msg"]


async def test_unknown_run_is_404(api: httpx.AsyncClient) -> None:
    for r in (await api.get("/v1/runs/run-nope"), await api.post("/v1/runs/run-nope/cancel"),
              await api.get("/v1/runs/run-nope/cost")):
        assert r.status_code == 404


async def test_cancel_then_cancel_finished_is_409(api: httpx.AsyncClient) -> None:
    run_id = (await api.post("/v1/runs", json=spec())).json()["id"]
    r = await api.post(f"/v1/runs/{run_id}/cancel")
    assert (r.status_code, r.json()["status"], r.json()["status_reason"]) == (200, "CANCELLING", "cancelled before it started")
    api.app.state.backends.state.set_status(run_id, RunStatus.CANCELLED)  # what the scheduler does next
    r = await api.post(f"/v1/runs/{run_id}/cancel")
    assert r.status_code == 409
    assert "already CANCELLED" in r.json()["detail"]


async def test_cost_of_new_run_is_zero(api: httpx.AsyncClient) -> None:
    run_id = (await api.post("/v1/runs", json=spec())).json()["id"]
    cost = (await api.get(f"/v1/runs/{run_id}/cost")).json()
    assert (cost["total_dollars"], cost["entries"], cost["currency"]) == (0.0, [], "USD")


async def test_health_and_metrics(api: httpx.AsyncClient) -> None:
    assert (await api.get("/healthz")).json() == {"status": "ok"}
    assert (await api.get("/readyz")).status_code == 200
    await api.post("/v1/runs", json=spec())
    text = (await api.get("/metrics")).text
    assert 'spotrl_runs{status="PENDING"} 1.0' in text
    assert "spotrl_policy_version{run=" in text
    assert (await api.get("/openapi.json")).json()["info"]["title"] == "spotrl"


async def test_token_required_when_configured(settings, tmp_path: Path) -> None:
    from services.api.main import create_app

    app = create_app(settings.model_copy(update={"api_token": "s3cret"}), with_scheduler=False)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://spotrl") as c:
            assert (await c.get("/v1/runs")).status_code == 401
            assert (await c.get("/v1/runs", headers={"Authorization": "Bearer s3cret"})).status_code == 200


def test_stored_spec_is_read_back_even_if_its_model_file_is_gone(tmp_path: Path) -> None:
    from services.runspec import RunSpec

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    stored = RunSpec.model_validate(spec(model=str(gguf))).model_dump(mode="json")
    gguf.unlink()
    assert RunSpec.from_stored(stored).model == str(gguf)
    with pytest.raises(ValueError, match="not usable"):
        RunSpec.model_validate(stored)


async def test_prompts_from_the_object_store(api: httpx.AsyncClient) -> None:
    api.app.state.backends.objects.put_bytes("datasets/add.jsonl", b'{"prompt": "1+1", "answer": "2"}\n')
    assert (await api.post("/v1/runs", json=spec(prompts="store://datasets/add.jsonl"))).status_code == 201
    r = await api.post("/v1/runs", json=spec(prompts="store://datasets/missing.jsonl"))
    assert r.status_code == 422
    assert "no object 'datasets/missing.jsonl'" in r.json()["detail"][0]["msg"]


async def test_cancelled_run_reads_cancelling_until_its_pods_are_gone(api: httpx.AsyncClient, settings, tmp_path: Path,
                                                                       wait_for) -> None:
    backends = api.app.state.backends
    scheduler = Scheduler(backends, settings)  # ticked by the test, step by step
    run_id = (await api.post("/v1/runs", json=spec())).json()["id"]
    scheduler.tick()
    assert (await api.get(f"/v1/runs/{run_id}")).json()["status"] == "RUNNING"
    # A stand-in rollout pod that ignores SIGTERM and exits once the test opens its gate.
    gate = tmp_path / "gate"
    wait = f"import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"
    backends.launcher.launch(PodSpec(name=f"{run_id}-rollout-0", run_id=run_id, role="rollout", command=[sys.executable, "-c", wait],
                                     env={}, instance_type="g6.xlarge", capacity_type="spot", labels={"slot": "0"}))
    backends.state.update_run(run_id, worker_slots_used=1)

    assert (await api.post(f"/v1/runs/{run_id}/cancel")).json()["status"] == "CANCELLING"
    scheduler.tick()  # stops the pod, which keeps running
    run = (await api.get(f"/v1/runs/{run_id}")).json()
    assert (run["status"], run["status_reason"], run["ended_at"]) == ("CANCELLING", "cancelled by the user", None)
    assert [p.name for p in backends.launcher.list(run_id)] == [f"{run_id}-rollout-0"]

    gate.touch()
    wait_for(lambda: scheduler.tick() or RunStatus(backends.state.get_run(run_id).status).is_terminal(),
             message="the run ended once its pod was gone")
    run = (await api.get(f"/v1/runs/{run_id}")).json()
    assert (run["status"], run["status_reason"]) == ("CANCELLED", "cancelled by the user")
    assert backends.launcher.list(run_id) == []


async def test_openapi_status_is_an_enum_of_every_status(api: httpx.AsyncClient) -> None:
    schemas = (await api.get("/openapi.json")).json()["components"]["schemas"]
    status = schemas["RunPublic"]["properties"]["status"]
    ref = status.get("$ref") or status["allOf"][0]["$ref"]
    assert schemas[ref.rsplit("/", 1)[1]]["enum"] == [s.value for s in RunStatus]
    assert "CANCELLING: " in status["description"]
    assert schemas["RunPublic"]["properties"]["last_error"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
