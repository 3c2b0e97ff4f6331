from __future__ import annotations

from itertools import pairwise

import pytest

from services.control.cost.cost_over_time import MAX_INSTANTS, STEP_SECONDS, cost_over_time
from services.control.cost.lower_bound import TrainingTerms
from services.control.cost.report import cost_report
from tests.services.control.cost.test_report import catalog, entry  # noqa: F401  (catalog is a fixture)


def test_the_curves_bend_where_pods_start_and_end_and_end_at_the_bill(catalog) -> None:  # noqa: F811
    entries = [
        entry(catalog, "rollout", "small", "spot", 0, 3600),  # $0.80/h spot, $2.00/h on-demand
        entry(catalog, "training", "big", "on-demand", 600, 900),  # $12.00/h on-demand, $6.00/h spot
    ]
    kw = dict(catalog=catalog, training=TrainingTerms("big"), run_started_at=0, run_ended_at=3600, now=9999)
    curve = cost_over_time(entries, **kw)
    # Each start, its minimum owed just after it, the minute's end (the test provider bills per
    # started minute, at least one), the training job's end and the run's.
    eps = STEP_SECONDS
    assert [c.at for c in curve] == pytest.approx([0, eps, 60, 600, 600 + eps, 660, 900, 3600])
    at_900 = curve[6]
    assert at_900.by_role_and_capacity == pytest.approx({("rollout", "spot"): 0.20, ("training", "on-demand"): 1.00})
    assert at_900.report.total_dollars == pytest.approx(1.20)
    assert at_900.report.always_on_dollars == pytest.approx(3.00 + 0.50)  # 900 s of big and of small, on-demand
    # the busy seconds: rollout at spot, training on-demand
    assert at_900.report.lower_bound_dollars == pytest.approx(0.20 + 1.00)
    assert curve[-1].report == cost_report(entries, **kw)  # the curve ends at the run's bill
    for earlier, later in pairwise(curve):
        assert later.report.total_dollars >= earlier.report.total_dollars
        assert later.report.always_on_dollars >= earlier.report.always_on_dollars


def test_an_open_entry_accrues_up_to_now_and_a_long_ledger_is_sampled(catalog) -> None:  # noqa: F811
    curve = cost_over_time(
        [entry(catalog, "rollout", "small", "spot", 100, None)],
        catalog=catalog,
        training=TrainingTerms("big"),
        run_started_at=0,
        run_ended_at=None,
        now=3700,
    )
    assert [c.at for c in curve] == pytest.approx([0, STEP_SECONDS, 60, 100, 100 + STEP_SECONDS, 160, 3700])
    assert curve[-1].report.total_dollars == pytest.approx(0.80)  # 1 h of spot so far
    many = [entry(catalog, "rollout", "small", "spot", i, i + 0.5) for i in range(MAX_INSTANTS)]  # 2 instants each
    curve = cost_over_time(
        many,
        catalog=catalog,
        training=TrainingTerms("big"),
        run_started_at=0,
        run_ended_at=MAX_INSTANTS,
        now=MAX_INSTANTS,
    )
    assert len(curve) == MAX_INSTANTS
    assert (curve[0].at, curve[-1].at) == (0, MAX_INSTANTS)
    # each half-second pod is billed AWS's 60 s minimum (services/control/cost/billing.py)
    assert curve[-1].report.total_dollars == pytest.approx(MAX_INSTANTS * 60 * 0.80 / 3600)


def test_a_pods_billing_minimum_is_a_step_at_its_start_then_cost_grows_per_second(catalog) -> None:  # noqa: F811
    """Not a ramp over the pod's life: the minute a provider bills at a machine's start is owed
    at once, then nothing more until it has run its minute, then per second."""
    entries = [entry(catalog, "training", "big", "on-demand", 600, 900)]  # $12.00/h: the minute is $0.20
    curve = cost_over_time(
        entries, catalog=catalog, training=TrainingTerms("big"), run_started_at=600, run_ended_at=900, now=900
    )
    spent = {round(c.at, 3): c.by_role_and_capacity.get(("training", "on-demand"), 0.0) for c in curve}
    assert spent[600] == 0.0  # nothing yet at the start itself
    assert spent[round(600 + STEP_SECONDS, 3)] == pytest.approx(60 * 12.00 / 3600)  # the minimum, at once
    assert spent[660] == pytest.approx(0.20)  # flat while the minimum lasts
    assert spent[900] == pytest.approx(300 * 12.00 / 3600)  # then per second
    just_after = next(c for c in curve if c.at > 600)
    assert just_after.at - 600 <= 0.01 and just_after.report.total_dollars == pytest.approx(0.20)
