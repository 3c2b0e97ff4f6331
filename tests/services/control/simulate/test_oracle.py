"""The offline optimum (``services.control.simulate.oracle``): a hand-computed schedule, and on a
shipped trace never dearer than a policy's simulated run nor cheaper than the lower bound."""

from __future__ import annotations

import pytest

from services.control.simulate.oracle import oracle
from services.control.simulate.traces import SpotTrace, parse_trace
from services.control.simulate.world import Workload, simulate
from services.domain.runspec import CostPolicy
from tests.services.control.simulate.trace_shapes import FOUR_NODES, MANY_NODES

# The catalog's prices per hour: the training node (p4d.24xlarge, on-demand), a rollout worker (g6.xlarge).
NODE, SPOT, ON_DEMAND = 21.96, 0.35, 0.8048
# Two batches of 900 samples at 1 sample/s per worker (900 worker-seconds each), 10 minutes of
# training, 90 s of start-up, at most 4 workers.
SMALL = Workload(
    batch_samples=900,
    iterations=2,
    workers=4,
    max_workers=4,
    worker_samples_per_hour=3600.0,
    training_minutes=10.0,
    startup_seconds=90.0,
    horizon_days=1.0,
)


def test_one_spot_worker_the_oracle_finds_the_hand_computed_optimum() -> None:
    # One spot worker all along. Batch 1: 900 s from the worker's start-up, launched at 990 s.
    # Job 1's node is new (S paid): started cold at the launch it ends at 990 + 90 + 600 = 1680 s,
    # when batch 2 must be complete for job 2 to take the same node at once: 690 s of the spot
    # worker and 210 worker-seconds on-demand. Holding the node longer costs 21.96/h a second
    # against 0.45/h of on-demand premium saved; a new node for job 2 costs S more.
    trace = parse_trace("one", {"metadata": {"gap_seconds": 60}, "data": [1] * 10})
    best = oracle(trace, SMALL)
    expected = ((2 * 600 + 90) * NODE + 1800 * SPOT + 210 * (ON_DEMAND - SPOT)) / 3600
    assert best.finished
    assert best.dollars == pytest.approx(expected, abs=1e-3)
    first, second = best.batches
    assert (first.launch, first.job_start, first.new_node) == (990.0, 1080.0, True)
    assert (second.launch, second.job_start, second.new_node) == (1680.0, 1680.0, False)
    assert second.on_demand_seconds == pytest.approx(210.0)
    assert best.wall_seconds == pytest.approx(2280.0)


def test_without_spot_capacity_rollout_is_on_demand_and_an_impossible_deadline_has_no_schedule() -> None:
    # No spot: 4 on-demand workers make a batch in 225 s, within a job's 600 s: one node, no gap.
    trace = parse_trace("none", {"metadata": {"gap_seconds": 60}, "data": [0]})
    best = oracle(trace, SMALL)
    assert best.dollars == pytest.approx(((2 * 600 + 90) * NODE + 1800 * ON_DEMAND) / 3600, abs=1e-3)
    assert best.new_nodes == 1
    # Two jobs of 10 minutes cannot end within 15.
    late = oracle(trace, Workload(**{**SMALL.__dict__, "deadline_hours": 0.25}))
    assert not late.finished


def test_a_deadline_buys_on_demand_rollout_where_waiting_for_spot_is_cheaper() -> None:
    # Spot capacity only after 2 hours: without a deadline the oracle waits for it.
    trace = parse_trace("late", {"metadata": {"gap_seconds": 60}, "data": [0] * 120 + [4] * 600})
    waits, hurries = oracle(trace, SMALL), oracle(trace, Workload(**{**SMALL.__dict__, "deadline_hours": 1.0}))
    assert sum(b.on_demand_seconds for b in waits.batches) == 0 and waits.wall_seconds > 7200
    assert hurries.finished and hurries.wall_seconds <= 3600
    assert sum(b.on_demand_seconds for b in hurries.batches) == pytest.approx(1800.0)
    assert hurries.dollars > waits.dollars


@pytest.mark.parametrize("trace", [MANY_NODES, FOUR_NODES], ids=lambda t: t.name)
def test_on_traces_of_the_shipped_kinds_no_policy_is_cheaper_and_the_bound_is_below(trace: SpotTrace) -> None:
    best = oracle(trace)
    assert best.finished
    for policy in CostPolicy:
        run = simulate(trace, policy)
        assert run.finished
        assert best.dollars <= run.dollars, policy
        assert best.lower_bound_dollars == pytest.approx(run.lower_bound_dollars, abs=1e-3)
    assert best.dollars >= best.lower_bound_dollars
