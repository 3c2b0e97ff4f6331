"""/v1/runs: submit, list, inspect, cancel, cost. Thin: the work is in ``services.api.service``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, status
from fastapi.concurrency import run_in_threadpool

from services.api import service
from services.api.deps import BackendsDep, CatalogDep, require_token
from services.api.schemas import CostPublic, RunPublic, RunsPublic
from services.runspec import RunSpec

router = APIRouter(prefix="/v1/runs", tags=["runs"], dependencies=[Depends(require_token)])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunPublic)
async def create_run(spec: RunSpec, backends: BackendsDep) -> RunPublic:
    return await run_in_threadpool(service.create_run, backends=backends, spec=spec)


@router.get("", response_model=RunsPublic)
async def list_runs(backends: BackendsDep) -> RunsPublic:
    return RunsPublic(runs=await run_in_threadpool(service.list_runs, backends=backends))


@router.get("/{run_id}", response_model=RunPublic)
async def get_run(run_id: str, backends: BackendsDep) -> RunPublic:
    return await run_in_threadpool(service.get_run, backends=backends, run_id=run_id)


@router.post("/{run_id}/cancel", response_model=RunPublic)
async def cancel_run(run_id: str, backends: BackendsDep) -> RunPublic:
    return await run_in_threadpool(service.cancel_run, backends=backends, run_id=run_id)


@router.get("/{run_id}/cost", response_model=CostPublic)
async def run_cost(run_id: str, backends: BackendsDep, catalog: CatalogDep) -> CostPublic:
    return await run_in_threadpool(service.run_cost, backends=backends, catalog=catalog, run_id=run_id)
