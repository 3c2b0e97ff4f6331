from __future__ import annotations

import pytest

from services.control.cost.lower_bound import TrainingTerms
from services.control.cost.report import cost_report
from services.ports.prices.catalog import UnknownInstanceTypeError, load_catalog
from services.ports.state.state_ledger import LedgerEntry

# Round prices, so that every figure below is worked out by hand.
CATALOG = """{"currency": "USD", "instances": {
  "small": {"gpu": "L4", "gpus": 1, "provider": "test", "region": "test", "on_demand": 2.00, "spot": 0.80,
            "source": "test", "date": "2025-06"},
  "big": {"gpu": "A100", "gpus": 8, "provider": "test", "region": "test", "on_demand": 12.00, "spot": 6.00,
          "source": "test", "date": "2025-06"}}}"""


@pytest.fixture
def catalog(tmp_path):
    path = tmp_path / "catalog.json"
    path.write_text(CATALOG)
    return load_catalog(path)


def entry(catalog, role: str, instance: str, capacity: str, start: float, end: float | None) -> LedgerEntry:
    price = catalog.get(instance).price(capacity)
    return LedgerEntry(
        id=0,
        run_id="r",
        role=role,
        pod=f"p-{start}",
        instance_type=instance,
        capacity_type=capacity,
        price_per_hour=price,
        price_source="test",
        started_at=start,
        ended_at=end,
    )


def test_report_against_always_on_and_lower_bound(catalog) -> None:
    entries = [
        entry(catalog, "rollout", "small", "spot", 0, 3600),  # 1 h at $0.80/h = $0.80
        entry(catalog, "rollout", "small", "on-demand", 0, 1800),  # 1800 s at $2.00/h = $1.00
        entry(catalog, "training", "big", "on-demand", 600, 900),  # 300 s at $12.00/h = $1.00
    ]
    r = cost_report(
        entries, catalog=catalog, training=TrainingTerms("big"), run_started_at=0, run_ended_at=3600, now=9999
    )
    assert r.by_role == pytest.approx({"rollout": 1.80, "training": 1.00})
    assert r.by_capacity_type == pytest.approx({"spot": 0.80, "on-demand": 2.00})
    assert r.total_dollars == pytest.approx(2.80)
    assert r.wall_seconds == 3600
    # The training instance on-demand for the run's hour ($12.00) and the 1.5 h of rollout at
    # the on-demand $2.00/h ($3.00).
    assert r.always_on_dollars == pytest.approx(15.00)
    # Every busy second at the cheapest price its role may run at: 1.5 h of rollout at spot's
    # $0.80/h ($1.20), 300 s of training on-demand at $12.00/h ($1.00).
    assert r.lower_bound_dollars == pytest.approx(2.20)
    assert r.savings_ratio == pytest.approx(15.00 / 2.80)  # 5.36x cheaper than always-on
    assert r.efficiency == pytest.approx(2.20 / 2.80)


def test_open_entries_are_billed_up_to_now(catalog) -> None:
    r = cost_report(
        [entry(catalog, "rollout", "small", "spot", 0, None)],
        catalog=catalog,
        training=TrainingTerms("big"),
        run_started_at=0,
        run_ended_at=None,
        now=7200,
    )
    assert r.total_dollars == pytest.approx(1.60)  # 2 h at $0.80/h
    assert r.wall_seconds == 7200
    assert r.always_on_dollars == pytest.approx(28.00)  # 2 h at $12.00/h + 2 h at $2.00/h
    assert r.lower_bound_dollars == pytest.approx(1.60)


def test_a_run_with_no_spend_has_no_ratios(catalog) -> None:
    r = cost_report([], catalog=catalog, training=TrainingTerms("big"), run_started_at=None, run_ended_at=None, now=50)
    assert (r.total_dollars, r.wall_seconds, r.always_on_dollars, r.lower_bound_dollars) == (0, 0, 0, 0)
    assert r.savings_ratio is None and r.efficiency is None


def test_unknown_instance_type_names_the_known_ones() -> None:
    with pytest.raises(UnknownInstanceTypeError, match="g6.xlarge"):
        load_catalog().get("x9.huge")


def test_catalog_from_spotrl_price_catalog(tmp_path, monkeypatch) -> None:
    """An operator's catalog (the Helm chart mounts one from a ConfigMap) replaces the shipped one."""
    from services.core.config import get_settings

    path = tmp_path / "catalog.json"
    path.write_text(CATALOG)
    monkeypatch.setenv("SPOTRL_PRICE_CATALOG", str(path))
    get_settings.cache_clear()
    try:
        assert sorted(load_catalog().instances) == ["big", "small"]
    finally:
        monkeypatch.delenv("SPOTRL_PRICE_CATALOG")
        get_settings.cache_clear()
    assert "p4d.24xlarge" in load_catalog().instances
