"""/v1/plan: a run's expected bill before it starts (``services.control.cost.planner``)."""

from __future__ import annotations

from fastapi import APIRouter

from services.control.api.deps import CatalogDep, PrincipalDep
from services.control.api.responses import errors
from services.control.cost.plan_schemas import PlanPublic, PlanRequest, plan_public, plan_request

router = APIRouter(prefix="/v1/plan", tags=["plan"], responses=errors(401))


@router.post("", response_model=PlanPublic, responses=errors(400, 413, 422))
async def plan(body: PlanRequest, catalog: CatalogDep, _: PrincipalDep) -> PlanPublic:
    """The cheapest rollout pool and training shape per update among the options given, the cost per
    update and per day against always-on, and each term's arithmetic. Pure arithmetic: no I/O."""
    return plan_public(plan_request(body, catalog))
