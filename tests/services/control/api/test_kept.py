"""What the API keeps between requests (``services.control.api.kept``): a run's bill, a page of an
ended run's cost and a run as GET shows it are computed once, and shown again only while what
they were computed from stands. The scheduler writes the store beside the API: every change it
makes shows at the next read."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from contracts.evaluation import EvalResult
from contracts.status import RunStatus
from services.control.api import service
from services.control.api.auth import NO_AUTH
from services.control.api.kept import Bill, Kept, _Lru
from services.core.config import Settings
from services.ports.prices.catalog import InstancePrice, PriceCatalog
from services.ports.state.state_store import LedgerEntry, StateStore
from tests.app_client import app_client
from tests.iteration_rows import iteration_row

SPEC = {"model": "tiny", "prompts": [{"prompt": "What is 2 + 3?", "answer": "5"}], "batch_samples": 8, "iterations": 2}
ROLLOUT = dict(role="rollout", instance_type="g6.xlarge", capacity_type="spot", price_per_hour=0.35, price_source="t")


async def _ended_run(api: httpx.AsyncClient) -> str:
    """A run that trained one iteration on one rollout pod (closed), then succeeded."""
    r = await api.post("/v1/runs", json=SPEC)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    state: StateStore = api.app.state.backends.state  # type: ignore[attr-defined]
    state.set_status(run_id, RunStatus.RUNNING)
    state.open_ledger(run_id=run_id, pod=f"{run_id}-rollout-0", started_at=1000.0, **ROLLOUT)
    state.close_ledger(f"{run_id}-rollout-0", ended_at=1600.0)
    state.record_iteration(iteration_row(run_id, 1, mean_reward=1 / 10, metrics={"actor/loss": 0.1}))
    state.begin_ending(run_id, RunStatus.SUCCEEDED, "trained")
    state.set_status(run_id, RunStatus.SUCCEEDED, "trained")
    return run_id


def _reads(api: httpx.AsyncClient) -> dict:
    app = api.app  # type: ignore[attr-defined]
    return dict(backends=app.state.backends, catalog=app.state.catalog, principal=NO_AUTH, kept=app.state.kept)


async def test_an_ended_run_is_shown_as_kept_until_the_store_changes_it(api: httpx.AsyncClient) -> None:
    run_id = await _ended_run(api)
    first = service.get_run(run_id=run_id, **_reads(api))
    assert service.get_run(run_id=run_id, **_reads(api)) is first  # kept: one statement told it stands
    assert (first.iterations_total, first.spent_dollars) == (1, pytest.approx(600 * 0.35 / 3600))
    # Whatever the scheduler (or a late pod) writes shows at the next GET.
    state: StateStore = api.app.state.backends.state  # type: ignore[attr-defined]
    state.update_run(run_id, last_error="the tracker is down")
    assert (await api.get(f"/v1/runs/{run_id}")).json()["last_error"] == "the tracker is down"
    state.count_reward_failures(run_id, {"function:timeout": 2}, latest="slow")
    assert (await api.get(f"/v1/runs/{run_id}")).json()["reward_failures_by_reason"] == {"function:timeout": 2}
    state.record_iteration(iteration_row(run_id, 2, mean_reward=2 / 10, metrics={"actor/loss": 0.1}))
    shown = (await api.get(f"/v1/runs/{run_id}?iterations_limit=1")).json()
    assert (shown["iterations_total"], [it["iteration"] for it in shown["iterations"]]) == (2, [2])
    # A pod billed after the end: an open entry costs more with every read, so it is never kept.
    state.open_ledger(run_id=run_id, pod=f"{run_id}-rollout-1", started_at=1600.0, **ROLLOUT)
    spent = [(await api.get(f"/v1/runs/{run_id}")).json()["spent_dollars"] for _ in range(2)]
    # (The second read bills as much or more, to float rounding: sums over some 1.7e9 s differ by 1e-10.)
    assert spent[0] > first.spent_dollars and spent[1] >= spent[0] * (1 - 1e-12)
    assert service.get_run(run_id=run_id, **_reads(api)) is not service.get_run(run_id=run_id, **_reads(api))


@pytest.fixture(params=["sqlite", "postgresql"])
async def api_on_each_store(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The API on a SQLite state store in its home, then on a database of its own on the session's PostgreSQL server."""
    url = None if request.param == "sqlite" else request.getfixturevalue("postgres").new_database()
    async with app_client(settings, state_url=url) as client:
        yield client


@contextmanager
def _transactions(state: StateStore) -> Iterator[list[list[str]]]:
    """The statements the store runs meanwhile, by transaction (SQLite's reading BEGIN goes to its
    driver: only what a transaction runs is counted, on both adapters)."""
    engine = state._engine
    transactions: list[list[str]] = []

    def begin(_conn: Any) -> None:
        transactions.append([])

    def execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        transactions[-1].append(statement)

    event.listen(engine, "begin", begin)
    event.listen(engine, "before_cursor_execute", execute)
    try:
        yield transactions
    finally:
        event.remove(engine, "before_cursor_execute", execute)
        event.remove(engine, "begin", begin)


async def test_a_get_of_a_kept_run_is_one_read_whether_it_changed_or_not(api_on_each_store: httpx.AsyncClient) -> None:
    api = api_on_each_store
    run_id = await _ended_run(api)
    state: StateStore = api.app.state.backends.state  # type: ignore[attr-defined]
    first = (await api.get(f"/v1/runs/{run_id}")).json()  # read, then kept
    with _transactions(state) as unchanged:
        assert (await api.get(f"/v1/runs/{run_id}")).json() == first
    assert [len(t) for t in unchanged] == [1]  # the run's stamp, and nothing else
    # An ended run that still gets evals: read again, in the transaction that read its stamp.
    state.open_eval(run_id, 1, launched_at=1700.0)
    result = EvalResult(
        policy_version=1, mean_score=0.5, metrics={"mean": 0.5}, prompts=2, samples=2, seconds=1.0, ended_at=1760.0
    )
    state.record_eval(run_id, result)
    with _transactions(state) as changed:
        shown = (await api.get(f"/v1/runs/{run_id}")).json()
    assert [e["policy_version"] for e in shown["evals"]] == [1]
    assert len(changed) == 1 and changed[0][0] == unchanged[0][0]  # one transaction, from the stamp
    assert len(set(changed[0])) == len(changed[0])  # the stamp read once, as every other statement
    with _transactions(state) as unchanged:
        assert (await api.get(f"/v1/runs/{run_id}")).json() == shown  # kept again
    assert [len(t) for t in unchanged] == [1]


async def test_another_tenants_kept_run_is_still_not_found(api: httpx.AsyncClient) -> None:
    run_id = await _ended_run(api)
    service.get_run(run_id=run_id, **_reads(api))  # kept
    reads = {**_reads(api), "principal": replace(NO_AUTH, tenant="other", admin=False)}
    with pytest.raises(KeyError):
        service.get_run(run_id=run_id, **reads)
    with pytest.raises(KeyError):
        service.run_cost(run_id=run_id, **reads)


async def test_an_ended_runs_cost_is_kept_while_its_ledger_and_prices_stand(api: httpx.AsyncClient) -> None:
    run_id = await _ended_run(api)
    first = service.run_cost(run_id=run_id, **_reads(api))
    assert service.run_cost(run_id=run_id, **_reads(api)) is first
    assert (first.entries_total, first.total_dollars) == (1, pytest.approx(600 * 0.35 / 3600))
    assert service.run_cost(run_id=run_id, limit=1, **_reads(api)) is not first  # another page
    # An entry added (and closed) after the end: a new ledger, a new bill and page.
    state: StateStore = api.app.state.backends.state  # type: ignore[attr-defined]
    state.open_ledger(run_id=run_id, pod=f"{run_id}-eval-1", started_at=1600.0, **{**ROLLOUT, "role": "eval"})
    state.close_ledger(f"{run_id}-eval-1", ended_at=1660.0)
    cost = (await api.get(f"/v1/runs/{run_id}/cost")).json()
    assert (cost["entries_total"], cost["by_role"]) == (
        2,
        {"rollout": pytest.approx(600 * 0.35 / 3600), "eval": pytest.approx(60 * 0.35 / 3600)},
    )
    listed = {r["id"]: r["spent_dollars"] for r in (await api.get("/v1/runs")).json()["runs"]}
    assert listed[run_id] == pytest.approx(cost["total_dollars"])


@dataclass(frozen=True)
class MovingSpot(PriceCatalog):
    """The catalog with spot prices that move, as a live feed's do."""

    spot: dict[str, float] = field(default_factory=dict)

    def get(self, instance_type: str) -> InstancePrice:
        price = super().get(instance_type)
        return replace(price, spot=self.spot.get(instance_type, price.spot))


async def test_a_kept_cost_follows_the_live_spot_price(api: httpx.AsyncClient) -> None:
    run_id = await _ended_run(api)
    app = api.app  # type: ignore[attr-defined]
    catalog = MovingSpot(app.state.catalog.currency, app.state.catalog.instances)
    reads = {**_reads(api), "catalog": catalog, "kept": Kept(catalog)}
    before = service.run_cost(run_id=run_id, **reads)
    assert service.run_cost(run_id=run_id, **reads) is before
    catalog.spot["g6.xlarge"] = 0.1  # the lower bound prices rollout work at spot now
    after = service.run_cost(run_id=run_id, **reads)
    assert after.lower_bound_dollars == pytest.approx(600 * 0.1 / 3600)
    assert after.total_dollars == before.total_dollars  # what was billed is what the ledger recorded


def _entry(i: int, *, ended: bool = True) -> LedgerEntry:
    return LedgerEntry(i, "r1", "rollout", f"p{i}", "g6.xlarge", "spot", 0.35, "t", 0.0, 100.0 if ended else None)


def test_bills_are_kept_for_closed_ledgers_only_and_held_by_the_request_that_found_them() -> None:
    from services.ports.prices.catalog import load_catalog

    kept = Kept(load_catalog(), max_entries=2)
    reader = kept.reader()
    assert reader.bill("r1", [_entry(1, ended=False)], now=50.0).total == pytest.approx(
        60 * 0.35 / 3600
    )  # AWS: 60 s at least
    assert reader.known("r1") is None  # open: not kept
    closed = reader.bill("r1", [_entry(1), _entry(2)], now=50.0)
    holder = kept.reader()
    assert holder.known("r1") == closed.stamp
    kept.reader().bill("r2", [_entry(3)], now=50.0)  # 3 entries kept: past the bound, r1 goes
    assert kept.reader().known("r1") is None
    assert holder.bill("r1", None, now=50.0) is closed  # the request that found it still has it
    assert isinstance(closed, Bill) and closed.billed == pytest.approx([100 * 0.35 / 3600] * 2)


def test_the_least_recently_read_go_first() -> None:
    lru: _Lru[str] = _Lru(bound=3)
    lru.put("a", "A", 1)
    lru.put("b", "B", 1)
    lru.put("c", "C", 1)
    assert lru.get("a") == "A"  # read: now the most recent
    lru.put("d", "D", 2)
    assert (lru.get("b"), lru.get("c"), lru.get("a"), lru.get("d")) == (None, None, "A", "D")
    lru.put("e", "E", 4)  # larger than the bound: not kept, nothing dropped
    assert (lru.get("e"), len(lru)) == (None, 2)
