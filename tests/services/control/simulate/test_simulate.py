"""The simulator on a short trace, driving the real plan(); and `spotrl simulate --json`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli.main import app
from services.control.cost.billing import NODE_BOOT_SECONDS
from services.control.scheduler.ledger_match import DEFER_STEP_SECONDS
from services.control.simulate.traces import load_trace, parse_trace
from services.control.simulate.world import Workload, simulate
from services.domain.runspec import CostPolicy
from services.ports.prices.catalog import load_catalog

# 4 spot instances, down to 1 for 20 minutes from minute 10, then back.
TRACE = {"metadata": {"gap_seconds": 60}, "data": [4] * 10 + [1] * 20 + [4] * 200}
# 3 batches of 400 samples; 4 workers at 1 sample/s; 5 min of training per batch, 60 s start-up.
SMALL = Workload(
    batch_samples=400,
    iterations=3,
    workers=4,
    max_workers=8,
    worker_samples_per_hour=3600.0,
    training_minutes=5.0,
    startup_seconds=60.0,
    spot_notice_seconds=30.0,
)


@pytest.fixture(scope="module")
def results() -> dict:
    trace = parse_trace("short", TRACE)
    return {policy: simulate(trace, policy, SMALL) for policy in CostPolicy}


def test_every_policy_trains_every_batch_and_pays_at_least_the_lower_bound(results) -> None:
    bounds = {r.lower_bound_dollars for r in results.values()}
    assert len(bounds) == 1  # the same work, whoever schedules it
    for r in results.values():
        assert r.samples_trained == 3 * 400 and r.samples_dropped_stale == 0
        assert r.dollars > r.lower_bound_dollars
        assert 0 < r.training_busy_fraction <= 1
        assert r.deadline_met is None


def test_the_capacity_drop_preempts_spot_workers_but_not_on_demand_ones(results) -> None:
    assert results[CostPolicy.THRESHOLD].preemptions >= 3  # 4 held, 1 left
    assert results[CostPolicy.ALWAYS_ON].preemptions == 0


def test_cost_aware_is_cheaper_than_the_rules(results) -> None:
    ca = results[CostPolicy.COST_AWARE]
    assert ca.dollars <= results[CostPolicy.THRESHOLD].dollars < results[CostPolicy.ALWAYS_ON].dollars
    assert ca.dollars < ca.always_on_dollars


def test_a_deadline_is_met_with_on_demand_rollout_where_spot_alone_misses_it() -> None:
    scarce = parse_trace("scarce", {"metadata": {"gap_seconds": 60}, "data": [1]})
    deadline = Workload(**{**SMALL.__dict__, "deadline_hours": 1700.0 / 3600.0})
    assert simulate(scarce, CostPolicy.THRESHOLD, deadline).deadline_met is False
    assert simulate(scarce, CostPolicy.COST_AWARE, deadline).deadline_met is True


def test_a_zone_without_spot_capacity_turns_to_on_demand_in_time_for_the_deadline() -> None:
    """No sample ever comes from spot, so there is no pace to project: cost-aware waits a quarter
    of the deadline for capacity, then starts its workers on-demand. Without a deadline it waits."""
    none = parse_trace("none", {"metadata": {"gap_seconds": 60}, "data": [0]})
    deadline = Workload(**{**SMALL.__dict__, "deadline_hours": 2.0, "horizon_days": 0.5})
    met = simulate(none, CostPolicy.COST_AWARE, deadline)
    assert met.deadline_met is True and met.samples_trained == 3 * 400
    assert met.wall_seconds >= 0.25 * 7200  # it gave spot its quarter first
    waited = simulate(none, CostPolicy.COST_AWARE, Workload(**{**SMALL.__dict__, "horizon_days": 0.5}))
    # Its workers waited for a node the whole time: each billed a boot and at most a step of it.
    spot = load_catalog().get(SMALL.rollout_instance_type).spot
    most = SMALL.max_workers * (NODE_BOOT_SECONDS + DEFER_STEP_SECONDS) * spot / 3600
    assert not waited.finished and 0 < waited.dollars <= most
    assert waited.gap["roll_startup"] == pytest.approx(waited.dollars, abs=1e-4)  # all of it waiting, none working


def test_workers_wait_for_spot_capacity_and_are_billed_from_when_it_comes() -> None:
    """No capacity for the first half hour: the workers launched at once wait for a node, take
    one when capacity comes, and the run costs what the same run started half an hour later does:
    their bills start when their nodes do (a boot before each joined)."""
    late = parse_trace("late", {"metadata": {"gap_seconds": 60}, "data": [0] * 30 + [4] * 200})
    at_once = parse_trace("at once", {"metadata": {"gap_seconds": 60}, "data": [4] * 230})
    waited, started = simulate(late, CostPolicy.THRESHOLD, SMALL), simulate(at_once, CostPolicy.THRESHOLD, SMALL)
    assert waited.samples_trained == started.samples_trained == 3 * 400 and waited.preemptions == 0
    assert waited.wall_seconds == pytest.approx(started.wall_seconds + 30 * 60, abs=SMALL.tick_seconds)
    assert waited.dollars == pytest.approx(started.dollars, abs=1e-4)


def test_a_malformed_trace_says_what_is_expected() -> None:
    with pytest.raises(ValueError, match="gap_seconds"):
        parse_trace("bad", {"data": [1, 2]})


def test_the_cli_writes_the_figures(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(TRACE))
    out = tmp_path / "out.json"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace),
            "--policy",
            "threshold",
            "--json",
            str(out),
            "--batch-samples",
            "400",
            "--iterations",
            "2",
            "--training-minutes",
            "5",
        ],
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert set(figures) == {
        "policy",
        "currency",
        "dollars",
        "wall_seconds",
        "lower_bound_dollars",
        "always_on_dollars",
        "samples_trained",
        "samples_dropped_stale",
        "preemptions",
        "training_preemptions",
        "training_busy_fraction",
        "deadline_met",
    }
    assert figures["policy"] == "threshold" and figures["samples_trained"] == 800
    assert figures["currency"] == "USD"  # g6.xlarge and p4d.24xlarge, the defaults


def test_the_cli_takes_a_trace_per_rollout_option_and_per_spot_training_zone(tmp_path: Path) -> None:
    paths = {}
    for name, data in (("rollout-a", [4] * 200), ("rollout-b", [2] * 200), ("dry", [0] * 200), ("wet", [1] * 200)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({"metadata": {"gap_seconds": 150}, "data": data}))
    out = tmp_path / "out.json"
    args = ["simulate", "--trace", str(paths["rollout-a"]), "--trace", str(paths["rollout-b"])]
    args += ["--training-trace", str(paths["dry"]), "--training-trace", str(paths["wet"])]
    args += ["--training-capacity", "spot", "--batch-samples", "400", "--iterations", "2", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    work = replace(Workload(), batch_samples=400, iterations=2, training_capacity="spot")
    traces = [load_trace(paths[n]) for n in ("rollout-a", "rollout-b")]
    want = simulate(traces, CostPolicy.COST_AWARE, work, training_trace=[load_trace(paths[n]) for n in ("dry", "wet")])
    assert json.loads(out.read_text()) == want.to_json()
    assert want.finished and want.samples_trained == 800  # on the wet zone's node: the dry one never has one
