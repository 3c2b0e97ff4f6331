"""A trace's spot prices bill the rollout tick by tick (``services.control.simulate.traces``)."""

from __future__ import annotations

import pytest

from services.control.simulate.traces import parse_trace
from services.control.simulate.world import Workload, simulate
from services.domain.runspec import CostPolicy
from services.ports.prices.catalog import parse_catalog

# Training free, rollout 3.6/h on spot (0.001 a second), so that the bill is the rollout's seconds.
CATALOG = parse_catalog(
    {
        "currency": "USD",
        "instances": {
            "g6.xlarge": {
                "gpu": "L4",
                "gpus": 1,
                "provider": "aws",
                "region": "test",
                "on_demand": 7.2,
                "spot": 3.6,
                "source": "test",
                "date": "2025-06",
            },
            "p4d.24xlarge": {
                "gpu": "A100-40GB",
                "gpus": 8,
                "provider": "aws",
                "region": "test",
                "on_demand": 0.0,
                "spot": 0.0,
                "source": "test",
                "date": "2025-06",
            },
        },
    }
)
# One worker makes the one batch: a group of 4 samples at 1 sample/s, after a 60 s start-up.
ONE_BATCH = Workload(
    batch_samples=4,
    samples_per_prompt=4,
    iterations=1,
    workers=1,
    max_workers=1,
    worker_samples_per_hour=3600.0,
    training_minutes=1.0,
    startup_seconds=60.0,
)
ONE_INSTANCE = {"metadata": {"gap_seconds": 60}, "data": [1] * 10}


def test_spot_cost_bills_each_tick_at_its_price() -> None:
    trace = parse_trace("priced", {"metadata": {"gap_seconds": 60}, "data": [1, 1, 1], "prices": [1.0, 2.0, 4.0]})
    assert trace.price_at(0) == 1.0 and trace.price_at(61) == 2.0 and trace.price_at(180) == 1.0  # repeats
    assert trace.spot_cost(30, 150) == pytest.approx((30 * 1 + 60 * 2 + 30 * 4) / 3600)
    assert trace.spot_cost(150, 210) == pytest.approx((30 * 4 + 30 * 1) / 3600)  # across the trace's end
    assert trace.spot_cost(0, 540) == pytest.approx(3 * 60 * 7 / 3600)  # three whole periods
    assert trace.cheapest_price() == 1.0


def test_prices_must_match_the_ticks() -> None:
    with pytest.raises(ValueError, match="one price >= 0 per tick"):
        parse_trace("short", {"metadata": {"gap_seconds": 60}, "data": [1, 1], "prices": [1.0]})


@pytest.mark.parametrize("policy", [CostPolicy.THRESHOLD, CostPolicy.COST_AWARE])
def test_trace_prices_replace_the_catalogs_spot_price(policy: CostPolicy) -> None:
    # At the catalog's 3.6/h: the worker is launched on the second tick (10 s), makes its group
    # from 70 s to 74 s and is stopped on the tick at 80 s: 70 s x 0.001 = 0.07.
    catalog_priced = simulate(parse_trace("flat", ONE_INSTANCE), policy, ONE_BATCH, CATALOG)
    assert catalog_priced.dollars == pytest.approx(0.07)
    assert catalog_priced.lower_bound_dollars == pytest.approx(0.004)  # 4 busy seconds
    # The trace's prices, 3.6/h then 18/h from 60 s: 50 s x 0.001 + 20 s x 0.005 = 0.15.
    trace = parse_trace("priced", {**ONE_INSTANCE, "prices": [3.6, 18.0] * 5})
    trace_priced = simulate(trace, policy, ONE_BATCH, CATALOG)
    assert trace_priced.dollars == pytest.approx(0.15)
    assert trace_priced.lower_bound_dollars == pytest.approx(0.004)  # at the cheapest tick's price
    assert sum(trace_priced.gap.values()) == pytest.approx(0.15 - 0.004)  # the parts still add up
