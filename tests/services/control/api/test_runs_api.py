"""The REST API's contract: valid specs are stored, bad input is refused with the field and the reason."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from contracts.evaluation import EvalResult
from contracts.status import RunStatus
from services.control.scheduler.loop import Scheduler
from services.domain.names import eval_prompts_key
from services.domain.prompts import parse_jsonl
from services.ports.launcher.launcher import PodSpec

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
    assert run["spec"]["rollout"] == {
        "instance_type": "g6.xlarge",
        "spot": True,
        "options": [],
        "min_workers": 2,
        "max_workers": 10,
        "prompts_per_batch": 8,
        "gpus_per_worker": 1,
        "engine": "hf",
        "vllm_dtype": None,
        "vllm_gpu_memory_utilization": None,
    }
    got = (await api.get(f"/v1/runs/{run['id']}")).json()
    assert got["name"] == "first"
    assert got["samples"] == {"produced": 0, "trained": 0, "dropped": 0, "filtered": 0}
    (listed,) = (await api.get("/v1/runs")).json()["runs"]
    assert listed["id"] == run["id"]
    # A listing is a summary: the spec and the iterations are for GET of the run.
    assert (
        {"spec", "iterations"}.isdisjoint(listed) and listed["status"] == "PENDING" and listed["spent_dollars"] == 0.0
    )


async def test_prompts_from_jsonl_file_in_a_data_dir(api: httpx.AsyncClient, tmp_path: Path) -> None:
    f = tmp_path / "data" / "p.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
    r = await api.post("/v1/runs", json=spec(prompts=str(f)))
    assert r.status_code == 201, r.text
    assert (r.json()["prompt_count"], r.json()["spec"]["prompts"]) == (2, str(f))


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
        ({"prompts": "/nonexistent/prompts.jsonl"}, "prompts", "SPOTRL_DATA_DIRS"),
        ({"model": "/nonexistent/model"}, "model", "SPOTRL_DATA_DIRS"),
        ({"sampling": {"temperature": -1}}, "temperature", "greater than or equal"),
        ({"budget_dollars": 0}, "budget_dollars", "greater than 0"),
        ({"surprise": 1}, "body", "unknown field"),
        ({"algorithm": "ppo", "training": {"adv_estimator": "rloo"}}, "body", "ppo uses gae"),
        ({"training": {"adv_estimator": "magic"}}, "adv_estimator", "rloo"),
    ],
)
async def test_invalid_spec_is_422_and_changes_nothing(
    api: httpx.AsyncClient, changes: dict, field: str, reason: str
) -> None:
    r = await api.post("/v1/runs", json=spec(**changes))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in map(str, d["loc"]) and reason in d["msg"] for d in detail), detail
    assert (await api.get("/v1/runs")).json()["runs"] == []


async def test_bad_jsonl_line_is_named(api: httpx.AsyncClient, tmp_path: Path) -> None:
    f = tmp_path / "data" / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    r = await api.post("/v1/runs", json=spec(prompts=str(f)))
    assert r.status_code == 422
    assert "line 2" in r.json()["detail"][0]["msg"]


async def test_unknown_run_is_404(api: httpx.AsyncClient) -> None:
    for r in (
        await api.get("/v1/runs/run-0123456789"),
        await api.post("/v1/runs/run-0123456789/cancel"),
        await api.get("/v1/runs/run-0123456789/cost"),
    ):
        assert r.status_code == 404


async def test_cancel_then_cancel_finished_is_409(api: httpx.AsyncClient) -> None:
    run_id = (await api.post("/v1/runs", json=spec())).json()["id"]
    r = await api.post(f"/v1/runs/{run_id}/cancel")
    assert (r.status_code, r.json()["status"], r.json()["status_reason"]) == (
        200,
        "CANCELLING",
        "cancelled before it started",
    )
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


async def test_a_server_path_is_checked_inside_the_data_dirs_only(api: httpx.AsyncClient, tmp_path: Path) -> None:
    gguf = tmp_path / "data" / "m.gguf"
    r = await api.post("/v1/runs", json=spec(model=str(gguf)))
    assert (r.status_code, r.json()["detail"][0]["loc"]) == (422, ["body", "model"])
    assert "no model directory" in r.json()["detail"][0]["msg"]
    gguf.write_bytes(b"GGUF")
    assert (await api.post("/v1/runs", json=spec(model=str(gguf)))).status_code == 201


async def test_gpus_per_worker_that_the_models_heads_or_the_nodes_gpus_do_not_take_is_refused(
    api: httpx.AsyncClient, tmp_path: Path
) -> None:
    alibaba = {"training": {"instance_type": "ecs.gn7e-c16g1.32xlarge"}}  # priced in CNY, as the rollout type
    two = {"instance_type": "ecs.gn7i-4x.8xlarge", "gpus_per_worker": 2, "engine": "vllm"}  # 4 x A10, 2 per worker
    r = await api.post("/v1/runs", json=spec(rollout=two, **alibaba))  # tiny: 4 heads
    assert (r.status_code, r.json()["spec"]["rollout"]["gpus_per_worker"]) == (201, 2), r.text
    # SmolLM2-135M's 9 attention heads do not split over 2 GPUs: refused before anything starts.
    r = await api.post("/v1/runs", json=spec(model="smollm2-135m", rollout=two, **alibaba))
    assert (r.status_code, r.json()["detail"][0]["loc"]) == (422, ["body", "rollout", "gpus_per_worker"])
    assert "9 attention heads" in r.json()["detail"][0]["msg"] and "use 1 or 3 GPUs" in r.json()["detail"][0]["msg"]
    # A model directory's config.json says its heads.
    model = tmp_path / "data" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"num_attention_heads": 12, "num_key_value_heads": 3}')
    r = await api.post("/v1/runs", json=spec(model=str(model), rollout=two, **alibaba))
    assert r.status_code == 422 and "3 key/value heads" in r.json()["detail"][0]["msg"], r.text
    # hf spreads layers, not heads: any model.
    r = await api.post("/v1/runs", json=spec(model=str(model), rollout={**two, "engine": "hf"}, **alibaba))
    assert r.status_code == 201, r.text
    # More GPUs than the node has: refused with what would fit.
    r = await api.post("/v1/runs", json=spec(rollout={"gpus_per_worker": 2}))
    assert r.status_code == 422 and "does not divide the 1 GPUs of g6.xlarge" in r.text, r.text


async def test_prompts_uploaded_as_a_dataset(api: httpx.AsyncClient) -> None:
    up = await api.post(
        "/v1/datasets",
        content=b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": "4"}\n',
        headers={"Content-Type": "application/x-ndjson"},
    )
    assert up.status_code == 201, up.text
    dataset = up.json()
    assert (dataset["prompts"], dataset["uri"]) == (2, f"store://datasets/{dataset['id']}.jsonl")
    r = await api.post("/v1/runs", json=spec(prompts=dataset["uri"]))
    assert (r.status_code, r.json()["prompt_count"]) == (201, 2)
    r = await api.post("/v1/runs", json=spec(prompts="store://datasets/missing.jsonl"))
    assert r.status_code == 422
    assert "no such object among this tenant's objects" in r.json()["detail"][0]["msg"]


async def test_cancelled_run_reads_cancelling_until_its_pods_are_gone(
    api: httpx.AsyncClient, settings, tmp_path: Path, wait_for
) -> None:
    backends = api.app.state.backends
    scheduler = Scheduler(backends, settings)  # ticked by the test, step by step
    run_id = (await api.post("/v1/runs", json=spec())).json()["id"]
    scheduler.tick()
    assert (await api.get(f"/v1/runs/{run_id}")).json()["status"] == "RUNNING"
    # A stand-in rollout pod that ignores SIGTERM and exits once the test opens its gate.
    gate = tmp_path / "gate"
    wait = f"import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"
    backends.launcher.launch(
        PodSpec(
            name=f"{run_id}-rollout-0",
            run_id=run_id,
            role="rollout",
            command=[sys.executable, "-c", wait],
            env={},
            instance_type="g6.xlarge",
            capacity_type="spot",
            labels={"slot": "0"},
        )
    )
    backends.state.update_run(run_id, worker_slots_used=1)

    assert (await api.post(f"/v1/runs/{run_id}/cancel")).json()["status"] == "CANCELLING"
    scheduler.tick()  # stops the pod, which keeps running
    run = (await api.get(f"/v1/runs/{run_id}")).json()
    assert (run["status"], run["status_reason"], run["ended_at"]) == ("CANCELLING", "cancelled by the user", None)
    assert [p.name for p in backends.launcher.list(run_id)] == [f"{run_id}-rollout-0"]

    gate.touch()
    wait_for(
        lambda: scheduler.tick() or RunStatus(backends.state.get_run(run_id).status).is_terminal(),
        message="the run ended once its pod was gone",
    )
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


async def test_a_method_the_path_does_not_serve_is_405_naming_those_it_does(api: httpx.AsyncClient) -> None:
    for path, allowed in (("/v1/runs", "GET, POST"), ("/v1/runs/some-run/cancel", "POST")):
        r = await api.delete(path)
        assert (r.status_code, r.headers.get("allow")) == (405, allowed), path


async def test_openapi_run_spec_is_one_schema_sent_and_shown(api: httpx.AsyncClient) -> None:
    """RunPublic.spec is the typed spec model, the very schema a client posts, not a free object."""
    doc = (await api.get("/openapi.json")).json()
    posted = doc["paths"]["/v1/runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert posted == {"$ref": "#/components/schemas/RunSpec"}
    assert doc["components"]["schemas"]["RunPublic"]["properties"]["spec"]["$ref"] == posted["$ref"]
    assert (
        doc["components"]["schemas"]["RunSpec"]["properties"]["training"]["$ref"] == "#/components/schemas/TrainConfig"
    )


HELD_OUT = [{"prompt": "What is 4 + 4?", "answer": "8"}, {"prompt": "What is 3 + 3?", "answer": "6"}]


async def test_a_held_out_set_is_stored_beside_the_run_and_its_evals_are_shown(api: httpx.AsyncClient) -> None:
    r = await api.post(
        "/v1/runs", json=spec(eval={"prompts": HELD_OUT, "samples_per_prompt": 2, "metrics": ["mean", "pass@2"]})
    )
    assert r.status_code == 201, r.text
    run = r.json()
    assert (run["spec"]["eval"]["prompts"], run["spec"]["eval"]["every_iterations"], run["evals"]) == ("inline", 1, [])
    backends = api.app.state.backends  # type: ignore[attr-defined]
    stored = parse_jsonl(backends.objects.get_bytes(eval_prompts_key(run["id"])), "the held-out set")
    assert [(item.prompt, item.answer) for item in stored] == [(p["prompt"], p["answer"]) for p in HELD_OUT]

    metrics = {"mean": 0.375, "pass@2": 0.5}  # as the scheduler records an eval pod's result
    backends.state.open_eval(run["id"], 0, launched_at=1.0)
    backends.state.record_eval(
        run["id"],
        EvalResult(
            policy_version=0, mean_score=0.375, metrics=metrics, prompts=2, samples=4, seconds=2.0, ended_at=3.0
        ),
    )
    got = (await api.get(f"/v1/runs/{run['id']}")).json()
    assert got["evals"] == [
        {"policy_version": 0, "mean_score": 0.375, "metrics": metrics, "prompts": 2, "seconds": 2.0, "ended_at": 3.0}
    ]
    text = (await api.get("/metrics")).text
    assert f'spotrl_eval_score{{metric="pass@2",run="{run["id"]}"}} 0.5' in text
    assert f'spotrl_eval_policy_version{{run="{run["id"]}"}} 0.0' in text


@pytest.mark.parametrize(
    ("changes", "loc", "reason"),
    [
        ({"eval": {"prompts": HELD_OUT, "metrics": ["pass@5"]}}, ["body", "eval"], "k <= samples_per_prompt (4)"),
        ({"eval": {"prompts": HELD_OUT, "metrics": ["median"]}}, ["body", "eval"], "`mean` and `pass@k`"),
        ({"eval": {"prompts": []}}, ["body", "eval", "prompts"], "at least one held-out prompt"),
        ({"eval": {"prompts": "store://datasets/missing.jsonl"}}, ["body", "eval", "prompts"], "no such object"),
        ({"eval": {"prompts": HELD_OUT, "every": 2}}, ["body", "eval"], "unknown field"),
    ],
)
async def test_a_bad_eval_section_is_422_naming_it(
    api: httpx.AsyncClient, changes: dict, loc: list[str], reason: str
) -> None:
    r = await api.post("/v1/runs", json=spec(**changes))
    assert r.status_code == 422, r.text
    assert any(d["loc"][: len(loc)] == loc and reason in d["msg"] for d in r.json()["detail"]), r.json()["detail"]
    assert (await api.get("/v1/runs")).json()["runs"] == []


async def test_an_eval_target_alone_is_a_goal(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/runs", json=spec(iterations=None, eval={"prompts": HELD_OUT, "target_score": 0.9}))
    assert r.status_code == 201, r.text


async def test_a_run_whose_trackers_the_operator_has_not_configured_is_refused_naming_the_setting(
    api: httpx.AsyncClient,
) -> None:
    spec = {
        "model": "tiny",
        "prompts": [{"prompt": "1+1", "answer": "2"}],
        "iterations": 1,
        "batch_samples": 4,
        "tracking": {"tensorboard": True, "mlflow": {"experiment": "gsm8k"}},
    }
    r = await api.post("/v1/runs", json=spec)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "tracking"]
    assert "SPOTRL_MLFLOW_TRACKING_URI" in r.json()["detail"][0]["msg"]
    del spec["tracking"]["mlflow"]
    assert (await api.post("/v1/runs", json=spec)).status_code == 201
