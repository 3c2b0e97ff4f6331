"""The CLI's API client against the API app in process: what the API hands out in pages, the
client reads whole."""

from __future__ import annotations

import io

import httpx
import pytest
from rich.console import Console
from starlette.testclient import TestClient

from contracts.status import RunStatus
from services.client.api import ApiClient, Target
from services.client.view import cost_table, run_details, run_progress
from services.control.api.main import create_app


def test_the_cost_of_a_long_run_is_read_page_by_page_and_its_iterations_said_to_be_the_latest(settings) -> None:
    with TestClient(create_app(settings, with_scheduler=False), base_url="http://spotrl") as app:
        run_id = app.post(
            "/v1/runs",
            json={"model": "tiny", "prompts": [{"prompt": "1+1", "answer": "2"}], "batch_samples": 8, "iterations": 5},
        ).json()["id"]
        state = app.app.state.backends.state
        for i in range(7):
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
            state.close_ledger(pod, ended_at=1060.0 + i, outcome="succeeded")

        def to_app(request: httpx.Request) -> httpx.Response:  # the client's requests, to the app in this process
            r = app.request(request.method, str(request.url), headers=dict(request.headers), content=request.read())
            return httpx.Response(r.status_code, headers=list(r.headers.items()), content=r.content)

        with ApiClient(Target("http://spotrl", None), transport=httpx.MockTransport(to_app)) as client:
            cost = client.run_cost(run_id, page_size=3)
            run = client.get_run(run_id)
    assert [e["pod"] for e in cost["entries"]] == [f"{run_id}-rollout-{i}" for i in range(7)]
    assert (cost["entries_total"], cost["next_cursor"]) == (7, None)
    assert run["iterations_total"] == 0 and run_progress(run).renderables[1].caption is None
    shown = run_progress({**run, "iterations": [], "iterations_total": 250})
    assert shown.renderables[1].caption == "the latest 0 of 250 iterations"


def test_a_runs_status_is_shown_with_its_meaning(settings) -> None:
    """`spotrl runs get` and `runs watch` say what the status means, under the status line."""
    with TestClient(create_app(settings, with_scheduler=False), base_url="http://spotrl") as app:
        run_id = app.post(
            "/v1/runs",
            json={"model": "tiny", "prompts": [{"prompt": "1+1", "answer": "2"}], "batch_samples": 8, "iterations": 5},
        ).json()["id"]
        run = app.get(f"/v1/runs/{run_id}").json()

    def shown(view) -> str:
        text = io.StringIO()
        Console(file=text, width=200).print(view)
        return text.getvalue()

    pending = shown(run_details(run))
    assert f"{run_id} PENDING" in pending and RunStatus.PENDING.meaning in pending
    ending = shown(run_progress({**run, "status": "ENDING", "status_reason": "budget spent"}))
    assert "ENDING (budget spent)" in ending and RunStatus.ENDING.meaning in ending
    assert RunStatus.PENDING.meaning not in ending
    # `runs watch` shows the latest held-out eval's figures, once a run has one.
    assert "held-out eval" not in ending
    evaluated = {
        **run,
        "evals": [
            {"policy_version": 0, "metrics": {"mean": 0.1}},
            {"policy_version": 2, "metrics": {"mean": 0.375, "pass@4": 0.5}},
        ],
    }
    assert "held-out eval of policy v2: mean 0.375 · pass@4 0.500" in shown(run_progress(evaluated))


def test_the_header_and_the_cost_table_say_one_spent_figure(settings) -> None:
    """`spotrl demo` and `runs watch` head the run with what it spent; `runs cost` (and the demo's
    last table) says it again: both are the cost report's total, billing minimums included. A
    10 s spot worker is billed AWS's 60 s minimum, which the raw seconds x price (the header's
    figure before) left out."""
    with TestClient(create_app(settings, with_scheduler=False), base_url="http://spotrl") as app:
        run_id = app.post(
            "/v1/runs",
            json={"model": "tiny", "prompts": [{"prompt": "1+1", "answer": "2"}], "batch_samples": 8, "iterations": 5},
        ).json()["id"]
        state = app.app.state.backends.state
        price = app.app.state.catalog.get("g6.xlarge").spot
        pod = f"{run_id}-rollout-0"
        state.open_ledger(
            run_id=run_id,
            role="rollout",
            pod=pod,
            instance_type="g6.xlarge",
            capacity_type="spot",
            price_per_hour=price,
            price_source="test",
            started_at=1000.0,
        )
        state.close_ledger(pod, ended_at=1010.0, outcome="preempted")
        run = app.get(f"/v1/runs/{run_id}").json()
        listed = app.get("/v1/runs").json()["runs"]
        cost = app.get(f"/v1/runs/{run_id}/cost").json()

    assert run["spent_dollars"] == cost["total_dollars"] == pytest.approx(60 * price / 3600)
    assert [r["spent_dollars"] for r in listed if r["id"] == run_id] == [cost["total_dollars"]]

    def shown(view) -> str:
        text = io.StringIO()
        Console(file=text, width=300).print(view)
        return text.getvalue()

    figure = f"{cost['total_dollars']:.4f}"
    assert f"spent ${figure}" in shown(run_progress(run))
    (total_row,) = [line for line in shown(cost_table(cost)).splitlines() if "spent in total" in line]
    assert figure in total_row
