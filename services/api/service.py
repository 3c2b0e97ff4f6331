"""Run operations behind the routes: keyword-only functions over the backends, no HTTP here."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict

from services.api.schemas import CostPublic, IterationPublic, LedgerEntryPublic, RunPublic, SampleCounts
from services.backends.state_schema import RunRow
from services.backends.state_store import StateStore
from services.cost.catalog import PriceCatalog
from services.cost.report import cost_report
from services.names import prompts_key
from services.prompts import load_prompts, to_jsonl
from services.runspec import RunSpec
from services.wiring import Backends


def new_run_id() -> str:
    # Lowercase and short: it prefixes Kubernetes object names (63 characters at most).
    return f"run-{uuid.uuid4().hex[:10]}"


def create_run(*, backends: Backends, spec: RunSpec) -> RunPublic:
    """Store the run's prompt set and the run (PENDING); the scheduler takes it from there."""
    prompts = load_prompts(spec.prompts, backends.objects)
    run_id = new_run_id()
    backends.objects.put_bytes(prompts_key(run_id), to_jsonl(prompts))
    row = backends.state.create_run(run_id, name=spec.name, spec=spec.model_dump(mode="json"))
    return run_public(row, state=backends.state)


def spent_dollars(state: StateStore, run_id: str, now: float) -> float:
    return sum(e.dollars(now) for e in state.ledger(run_id))


def run_public(row: RunRow, *, state: StateStore) -> RunPublic:
    return RunPublic(
        id=row.id,
        name=row.name,
        status=row.status,
        status_reason=row.status_reason,
        created_at=row.created_at,
        started_at=row.started_at,
        ended_at=row.ended_at,
        policy_version=row.policy_version,
        samples=SampleCounts(produced=row.samples_produced, trained=row.samples_trained, dropped=row.samples_dropped),
        iterations=[IterationPublic.model_validate(it, from_attributes=True) for it in state.iterations(row.id)],
        spent_dollars=spent_dollars(state, row.id, time.time()),
        spec=RunSpec.from_stored(row.spec),
        last_error=row.last_error,
    )


def get_run(*, backends: Backends, run_id: str) -> RunPublic:
    return run_public(backends.state.get_run(run_id), state=backends.state)


def list_runs(*, backends: Backends) -> list[RunPublic]:
    return [run_public(r, state=backends.state) for r in backends.state.list_runs()]


def cancel_run(*, backends: Backends, run_id: str) -> RunPublic:
    return run_public(backends.state.request_cancel(run_id), state=backends.state)


def run_cost(*, backends: Backends, catalog: PriceCatalog, run_id: str) -> CostPublic:
    row = backends.state.get_run(run_id)
    entries = backends.state.ledger(run_id)
    now = time.time()
    report = cost_report(
        entries,
        catalog=catalog,
        training_instance_type=row.spec["training"]["instance_type"],
        run_started_at=row.started_at,
        run_ended_at=row.ended_at,
        now=now,
    )
    return CostPublic(
        run_id=run_id,
        currency=catalog.currency,
        total_dollars=report.total_dollars,
        by_role=report.by_role,
        by_capacity_type=report.by_capacity_type,
        wall_seconds=report.wall_seconds,
        always_on_dollars=report.always_on_dollars,
        lower_bound_dollars=report.lower_bound_dollars,
        savings_ratio=report.savings_ratio,
        efficiency=report.efficiency,
        entries=[
            LedgerEntryPublic.model_validate({**asdict(e), "seconds": e.seconds(now), "dollars": e.dollars(now)})
            for e in entries
        ],
    )
