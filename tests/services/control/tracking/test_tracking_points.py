"""A recorded iteration as a tracker's point: the job's metrics under verl's names, plus the control
plane's own figures; the cost so far is the cost report's figure at the iteration's end."""

from __future__ import annotations

import pytest

from services.control.cost.lower_bound import TrainingTerms
from services.control.cost.report import cost_report
from services.control.tracking.points import Point, dollars_at, eval_point, iteration_point
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_store import StateStore
from tests.services.control.tracking.tracking_support import T0, job_metrics, make_run, record


def test_an_iteration_point_carries_the_jobs_metrics_and_the_control_planes_figures(store: StateStore) -> None:
    make_run(store, "r1", iterations=2)
    row = store.iterations("r1")[1]
    point = iteration_point(row, dollars_so_far=1.25)
    assert (point.step, point.wall_time) == (2, T0 + 200)
    recorded = {k: v for k, v in job_metrics(2).items() if v is not None}
    assert {k: point.values[k] for k in recorded} == recorded  # verl's names, as the job recorded them
    assert "critic/explained_variance" not in point.values  # NaN, stored as null: no figure
    assert point.values["timing_s/iteration"] == 32.0
    assert (point.values["data/samples_trained"], point.values["data/samples_dropped"]) == (64.0, 0.0)
    assert point.values["cost/dollars_so_far"] == 1.25
    assert not point.is_eval()


def test_reward_mean_falls_back_to_the_iterations_mean_reward(store: StateStore) -> None:
    make_run(store, "r1", iterations=1)
    row = store.iterations("r1")[0]
    row.metrics = {"actor/pg_loss": 0.1, "eval/leak": 3.0}  # a job that recorded no reward/mean
    values = iteration_point(row, 0.0).values
    assert values["reward/mean"] == pytest.approx(0.1)
    assert "eval/leak" not in values  # eval/ belongs to held-out evaluations


def test_the_cost_so_far_is_the_cost_reports_figure_at_that_instant(store: StateStore, catalog: PriceCatalog) -> None:
    make_run(store, "r1")
    store.open_ledger(
        run_id="r1",
        role="training",
        pod="r1-train-1",
        instance_type="p4d.24xlarge",
        capacity_type="on-demand",
        price_per_hour=21.96,
        price_source="test",
        started_at=T0 + 50,
    )
    store.close_ledger("r1-train-1", ended_at=T0 + 80)
    entries = store.ledger("r1")
    # At T0 + 30 only the rollout worker ran, 30 s, billed AWS's 60 s minimum.
    assert dollars_at(entries, catalog, T0 + 30) == pytest.approx(60 * 0.35 / 3600)
    # At T0 + 500: the worker's 500 s and the training job's 30 s billed as 60 s.
    assert dollars_at(entries, catalog, T0 + 500) == pytest.approx(500 * 0.35 / 3600 + 60 * 21.96 / 3600)
    # The same figure as the run's cost report then.
    report = cost_report(
        entries,
        catalog=catalog,
        training=TrainingTerms("p4d.24xlarge"),
        run_started_at=T0,
        run_ended_at=T0 + 500,
        now=T0 + 500,
    )
    assert dollars_at(entries, catalog, T0 + 500) == pytest.approx(report.total_dollars)


def test_an_eval_point_puts_its_scores_under_eval(store: StateStore) -> None:
    point = eval_point(3, T0 + 999, {"mean_score": 0.5, "pass@4": 0.75, "eval/mean": 0.5})
    assert point == Point(3, T0 + 999, {"eval/mean_score": 0.5, "eval/pass@4": 0.75, "eval/mean": 0.5})
    assert point.is_eval()
    make_run(store, "r2")
    record(store, "r2", 1)
    assert not iteration_point(store.iterations("r2")[0], 0.0).is_eval()
