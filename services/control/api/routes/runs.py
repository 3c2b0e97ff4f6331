"""/v1/runs: submit, list, inspect, cancel, cost, report page, pod logs. Thin: the work is in ``services.control.api.service``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status
from fastapi.responses import HTMLResponse

from services.control.api import service
from services.control.api.deps import CallerDep
from services.control.api.responses import errors, json_errors
from services.control.api.schemas import CostPublic, PodLogPublic, PodsPublic, RunPublic, RunsPublic
from services.control.cost.report_page import CSP
from services.domain.runspec import SubmittedRunSpec

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=errors(401))

RunId = Annotated[
    str, Path(max_length=64, pattern=r"^run-[0-9a-f]{1,40}$", description="A run's id, `run-` and hex digits.")
]
PodName = Annotated[
    str,
    Path(
        max_length=63,
        pattern=r"^run-[0-9a-f]{1,40}-((train|rollout|eval|warm)-[0-9]{1,9}|reward)$",
        description="A pod of the run: `<run>-rollout-<slot>`, `<run>-train-<iteration>`, `<run>-eval-<version>`, "
        "`<run>-warm-<iteration>` or `<run>-reward` (GET the run's pods for them).",
    ),
]
# A kept log holds the last 2000 lines (services.control.scheduler.apply.LOG_LINES_KEPT): more is never there.
MAX_TAIL = 2000


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunPublic, responses=errors(400, 413))
async def create_run(spec: SubmittedRunSpec, caller: CallerDep) -> RunPublic:
    return await caller.run(
        service.create_run, backends=caller.backends, settings=caller.settings, principal=caller.principal, spec=spec
    )


@router.get("", response_model=RunsPublic, responses=errors(400))
async def list_runs(
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=200, description="Runs per page.")] = 50,
    cursor: Annotated[str | None, Query(max_length=200, description="`next_cursor` of the previous page.")] = None,
) -> RunsPublic:
    return await caller.run_on_runs(service.list_runs, limit=limit, cursor=cursor)


@router.get("/{run_id}", response_model=RunPublic, responses=errors(404))
async def get_run(
    run_id: RunId,
    caller: CallerDep,
    iterations_limit: Annotated[
        int,
        Query(
            ge=0,
            le=service.MAX_ITERATIONS_SHOWN,
            description="The latest iterations shown (`iterations_total` counts all).",
        ),
    ] = service.DEFAULT_ITERATIONS_SHOWN,
) -> RunPublic:
    return await caller.run_on_runs(service.get_run, run_id=run_id, iterations_shown=iterations_limit)


@router.post("/{run_id}/cancel", response_model=RunPublic, responses=errors(404, 409))
async def cancel_run(run_id: RunId, caller: CallerDep) -> RunPublic:
    return await caller.run_on_runs(service.cancel_run, run_id=run_id)


@router.get("/{run_id}/cost", response_model=CostPublic, responses=errors(400, 404))
async def run_cost(
    run_id: RunId,
    caller: CallerDep,
    limit: Annotated[
        int, Query(ge=1, le=service.MAX_ENTRIES_PAGE, description="Ledger entries per page.")
    ] = service.DEFAULT_ENTRIES_PAGE,
    cursor: Annotated[str | None, Query(max_length=200, description="`next_cursor` of the previous page.")] = None,
) -> CostPublic:
    """The run's bill (totals over its whole ledger) and one page of its ledger entries."""
    return await caller.run_on_runs(service.run_cost, run_id=run_id, limit=limit, cursor=cursor)


@router.get("/{run_id}/report", response_class=HTMLResponse, responses=json_errors(401, 404))
async def run_report(run_id: RunId, caller: CallerDep) -> HTMLResponse:
    """The run's report page: one self-contained HTML page (reward by iteration, cumulative cost
    against always-on and the lower bound, pod timelines with preemptions marked) that loads nothing."""
    page = await caller.run(
        service.run_report, backends=caller.backends, catalog=caller.catalog, principal=caller.principal, run_id=run_id
    )
    return HTMLResponse(page, headers={"Content-Security-Policy": CSP})


@router.get("/{run_id}/pods", response_model=PodsPublic, responses=errors(404))
async def run_pods(run_id: RunId, caller: CallerDep) -> PodsPublic:
    """The run's pods that have a log: running, or ended (their log kept by the scheduler)."""
    return await caller.run(service.run_pods, backends=caller.backends, principal=caller.principal, run_id=run_id)


@router.get("/{run_id}/pods/{pod}/logs", response_model=PodLogPublic, responses=errors(404))
async def pod_logs(
    run_id: RunId,
    pod: PodName,
    caller: CallerDep,
    tail: Annotated[int, Query(ge=1, le=MAX_TAIL, description="Lines from the end of the log.")] = 100,
) -> PodLogPublic:
    """The last lines of a pod's log, from the launcher while it has the pod, else as kept when it ended."""
    return await caller.run(
        service.pod_log, backends=caller.backends, principal=caller.principal, run_id=run_id, pod=pod, tail=tail
    )
