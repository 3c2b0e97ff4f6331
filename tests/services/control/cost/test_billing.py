"""Each provider's billing rule, and the cost report that applies it to every entry."""

from __future__ import annotations

import pytest

from services.control.cost.billing import HANDOVER_SECONDS, PER_MINUTE, billed_dollars, billed_seconds, rule_for
from services.control.cost.lower_bound import TrainingTerms
from services.control.cost.report import cost_report
from services.ports.prices.catalog import load_catalog
from services.ports.state.state_ledger import LedgerEntry


@pytest.mark.parametrize(
    ("provider", "seconds", "billed"),
    [
        ("aws", 0.0, 0.0),  # never ran: nothing
        ("aws", 10.0, 60.0),  # the 60 s minimum
        ("aws", 61.2, 62.0),  # then per second, rounded up
        ("aws", 299.9999999, 300.0),  # float noise does not round up a whole second
        ("gcp", 30.0, 60.0),
        ("gcp", 90.5, 91.0),
        ("alibaba", 3600.0, 3600.0),
        ("no-such-cloud", 61.0, 120.0),  # unknown: per started minute
    ],
)
def test_billed_seconds(provider: str, seconds: float, billed: float) -> None:
    assert billed_seconds(seconds, rule_for(provider)) == billed


def test_unknown_providers_are_billed_per_minute() -> None:
    assert rule_for("no-such-cloud") is PER_MINUTE


def entry(instance: str, capacity: str, start: float, end: float | None, role: str = "rollout") -> LedgerEntry:
    price = load_catalog().get(instance).price(capacity)
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


def test_the_report_bills_each_entry_by_its_providers_rule() -> None:
    # A g5.xlarge spot worker preempted after 10 s is billed AWS's minute at $0.45/h; the
    # training job (p4d, 2 h 0.5 s) per second, rounded up.
    entries = [entry("g5.xlarge", "spot", 0, 10), entry("p4d.24xlarge", "on-demand", 0, 7200.5, role="training")]
    r = cost_report(
        entries,
        catalog=load_catalog(),
        training=TrainingTerms("p4d.24xlarge"),
        run_started_at=0,
        run_ended_at=7201,
        now=9999,
    )
    assert r.currency == "USD"
    assert r.by_role == pytest.approx({"rollout": 60 * 0.45 / 3600, "training": 7201 * 21.96 / 3600})
    # Always-on is billed by the same rules: p4d held the run's 7201 s, the worker's minute on-demand.
    assert r.always_on_dollars == pytest.approx(7201 * 21.96 / 3600 + 60 * 1.006 / 3600)
    # The lower bound pays busy seconds only, no minimum: the worker at spot, training on-demand.
    assert r.lower_bound_dollars == pytest.approx(10 * 0.45 / 3600 + 7200.5 * 21.96 / 3600)


def test_an_alibaba_run_reports_in_cny() -> None:
    entries = [
        entry("ecs.gn8is-4x.16xlarge", "spot", 0, 3600),
        entry("ecs.gn7e-c16g1.32xlarge", "on-demand", 0, 1800, role="training"),
    ]
    r = cost_report(
        entries,
        catalog=load_catalog(),
        training=TrainingTerms("ecs.gn7e-c16g1.32xlarge"),
        run_started_at=0,
        run_ended_at=3600,
        now=3600,
    )
    assert r.currency == "CNY"
    assert r.total_dollars == pytest.approx(25 + 110)  # 1 h at the CNY 25/h point, 30 min at CNY 220/h


def test_pods_that_hand_a_training_node_over_share_its_minimum_and_pay_its_idle_seconds() -> None:
    # A standby holds a p4d node for 20 s, hands it to a job 10 s later (same machine: one 60 s
    # minimum, the 10 s between them the job's); the next job starts after the node was taken back.
    per_s = load_catalog().get("p4d.24xlarge").on_demand / 3600.0
    late = 45 + HANDOVER_SECONDS + 1
    entries = [
        entry("p4d.24xlarge", "on-demand", 0, 20, role="standby"),
        entry("p4d.24xlarge", "on-demand", 30, 45, role="training"),
        entry("p4d.24xlarge", "on-demand", late, late + 30, role="training"),
        entry("g5.xlarge", "on-demand", 20, 30),  # another machine, whatever its times
    ]
    standby, job, later_job, worker = billed_dollars(entries, load_catalog(), now=1000)
    assert standby == pytest.approx((20 + 15) * per_s)  # its seconds, and the machine's minimum (60) topped up
    assert job == pytest.approx(25 * per_s)  # from the standby's end: the idle 10 s and its own 15 s
    assert standby + job == pytest.approx(60 * per_s)  # one machine, 45 s: its minimum
    assert later_job == pytest.approx(60 * per_s)  # a new machine, a new minimum
    assert worker == pytest.approx(60 * load_catalog().get("g5.xlarge").on_demand / 3600.0)
