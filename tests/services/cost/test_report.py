from __future__ import annotations

import pytest

from services.backends.state_store import LedgerEntry
from services.cost.catalog import UnknownInstanceTypeError, load_catalog
from services.cost.report import cost_report


def entry(role: str, instance: str, capacity: str, start: float, end: float | None) -> LedgerEntry:
    price = load_catalog().get(instance).price(capacity)
    return LedgerEntry(id=0, run_id="r", role=role, pod=f"p-{start}", instance_type=instance, capacity_type=capacity,
                       price_per_hour=price, price_source="test", started_at=start, ended_at=end)


def test_report_against_always_on_and_lower_bound() -> None:
    catalog = load_catalog()
    g6, p4d = catalog.get("g6.xlarge"), catalog.get("p4d.24xlarge")
    entries = [
        entry("rollout", "g6.xlarge", "spot", 0, 3600),
        entry("rollout", "g6.xlarge", "spot", 0, 1800),
        entry("training", "p4d.24xlarge", "on-demand", 600, 900),
    ]
    r = cost_report(entries, catalog=catalog, training_instance_type="p4d.24xlarge", run_started_at=0,
                    run_ended_at=3600, now=9999)
    assert r.by_role["rollout"] == pytest.approx(1.5 * g6.spot)
    assert r.by_role["training"] == pytest.approx(p4d.on_demand / 12)
    assert r.total_dollars == pytest.approx(1.5 * g6.spot + p4d.on_demand / 12)
    assert r.always_on_dollars == pytest.approx(p4d.on_demand + 1.5 * g6.on_demand)
    assert r.lower_bound_dollars == pytest.approx(1.5 * g6.spot + p4d.spot / 12)
    assert r.savings_ratio == pytest.approx(r.always_on_dollars / r.total_dollars)
    assert r.savings_ratio > 1


def test_open_entries_are_billed_up_to_now() -> None:
    catalog = load_catalog()
    r = cost_report([entry("rollout", "g6.xlarge", "spot", 0, None)], catalog=catalog,
                    training_instance_type="p4d.24xlarge", run_started_at=0, run_ended_at=None, now=7200)
    assert r.total_dollars == pytest.approx(2 * catalog.get("g6.xlarge").spot)
    assert r.wall_seconds == 7200


def test_unknown_instance_type_names_the_known_ones() -> None:
    with pytest.raises(UnknownInstanceTypeError, match="g6.xlarge"):
        load_catalog().get("x9.huge")
