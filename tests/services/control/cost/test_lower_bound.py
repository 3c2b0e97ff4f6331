from __future__ import annotations

from html import escape
from io import StringIO

import pytest
from rich.console import Console

from services.client.view import cost_table
from services.control.api.schemas import CostPublic
from services.control.cost.lower_bound import (
    LOWER_BOUND_DEFINITION,
    LOWER_BOUND_MEANING,
    Busy,
    TrainingTerms,
    cheapest_allowed_price,
    lower_bound_dollars,
)
from services.control.cost.report import cost_report
from services.control.cost.report_page import report_page
from tests.services.control.cost.test_report import catalog, entry  # noqa: F401  (catalog is a fixture)


def test_each_role_is_priced_at_the_cheapest_price_it_may_run_at(catalog) -> None:  # noqa: F811
    small, big = catalog.get("small"), catalog.get("big")  # spot $0.80/h and $6.00/h, on-demand $2.00/h and $12.00/h
    assert [cheapest_allowed_price(role, small, False) for role in ("rollout", "eval", "reward")] == [0.80] * 3
    assert cheapest_allowed_price("training", big, False) == 12.00  # the run trains on-demand only
    assert cheapest_allowed_price("training", big, True) == 6.00  # its training.capacity allows spot
    assert cheapest_allowed_price("standby", big, True) == 0.0  # a warm node does no work
    busy = [Busy("rollout", 3600, small), Busy("training", 1800, big), Busy("standby", 600, big)]
    assert lower_bound_dollars(busy, training_spot=False) == pytest.approx(0.80 + 6.00)
    assert lower_bound_dollars(busy, training_spot=True) == pytest.approx(0.80 + 3.00)


def test_a_stored_spec_says_whether_its_training_may_run_on_spot() -> None:
    assert TrainingTerms.of_stored({"training": {"instance_type": "big"}}) == TrainingTerms("big", spot=False)
    for capacity, spot in (("on-demand", False), ("spot", True), ("auto", True)):
        stored = {"training": {"instance_type": "big", "capacity": capacity}}
        assert TrainingTerms.of_stored(stored) == TrainingTerms("big", spot=spot)
    assert TrainingTerms.of_stored({"training": {"instance_type": "big", "nodes": 4}}).nodes == 4


def test_a_job_of_several_nodes_is_billed_and_bounded_per_node_and_always_on_holds_them_all(catalog) -> None:  # noqa: F811
    """Each node of a 2-node job has its own ledger entry (``node_names``): both billed, both in
    the bound; the always-on cluster holds both nodes for the run's wall time."""
    entries = [entry(catalog, "training", "big", "on-demand", 600, 2400) for _ in range(2)]
    one = cost_report(
        entries[:1], catalog=catalog, training=TrainingTerms("big"), run_started_at=0, run_ended_at=3600, now=9999
    )
    two = cost_report(
        entries, catalog=catalog, training=TrainingTerms("big", nodes=2), run_started_at=0, run_ended_at=3600, now=9999
    )
    assert two.total_dollars == pytest.approx(2 * one.total_dollars) == pytest.approx(12.00)
    assert two.lower_bound_dollars == pytest.approx(2 * one.lower_bound_dollars)
    assert two.always_on_dollars == pytest.approx(2 * one.always_on_dollars) == pytest.approx(24.00)


def test_the_reports_lower_bound_prices_training_on_demand_and_a_standby_at_nothing(catalog) -> None:  # noqa: F811
    entries = [
        entry(catalog, "rollout", "small", "spot", 0, 3600),  # busy 1 h: $0.80 at spot
        entry(catalog, "eval", "small", "on-demand", 0, 1800),  # ran on-demand, could have run on spot: $0.40
        entry(catalog, "standby", "big", "on-demand", 0, 600),  # idle: nothing
        entry(catalog, "training", "big", "on-demand", 600, 2400),  # 1800 s on-demand: $6.00
    ]
    r = cost_report(
        entries, catalog=catalog, training=TrainingTerms("big"), run_started_at=0, run_ended_at=3600, now=9999
    )
    # Pricing every pod at its instance type's spot price (training $3.00, standby $1.00) made
    # 5.20; the run could not have paid that with training on-demand.
    assert r.lower_bound_dollars == pytest.approx(0.80 + 0.40 + 6.00)
    assert r.lower_bound_dollars <= r.total_dollars


def test_the_page_the_api_and_the_cli_state_the_one_definition(catalog) -> None:  # noqa: F811
    page = report_page(
        run_id="r",
        status="SUCCEEDED",
        currency="USD",
        iterations=[],
        entries=[entry(catalog, "training", "big", "on-demand", 0, 60)],
        catalog=catalog,
        training=TrainingTerms("big"),
        run_started_at=0,
        run_ended_at=60,
        now=60,
    )
    assert f'<p class="note">{escape(LOWER_BOUND_DEFINITION)}</p>' in page
    assert CostPublic.model_fields["lower_bound_dollars"].description == LOWER_BOUND_MEANING
    cost = {
        "currency": "USD",
        "by_role": {"training": 0.2},
        "by_capacity_type": {"on-demand": 0.2},
        "total_dollars": 0.2,
        "always_on_dollars": 0.2,
        "lower_bound_dollars": 0.2,
        "lower_bound_definition": LOWER_BOUND_DEFINITION,
        "savings_ratio": 1.0,
        "wall_seconds": 60.0,
        "entries": [{"role": "training", "seconds": 60.0}],
    }
    out = StringIO()
    Console(file=out, width=400).print(cost_table(cost))
    assert LOWER_BOUND_DEFINITION in out.getvalue()
