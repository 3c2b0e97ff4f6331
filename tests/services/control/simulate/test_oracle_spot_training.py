"""The offline optimum with spot training (``services.control.simulate.oracle`` given a training
trace): hand-computed preemptions, spot training at the spot price where nodes are steady, the
on-demand optimum where none come, and on traces of the shipped kinds never dearer than the
on-demand optimum nor than the simulator's cost-aware run with ``training.capacity`` auto."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import pytest

from services.control.simulate.oracle import OracleResult, Ran, oracle
from services.control.simulate.traces import SpotTrace, parse_trace
from services.control.simulate.world import SimResult, Workload, simulate
from services.domain.runspec import CostPolicy
from tests.services.control.simulate.trace_shapes import FOUR_NODES, LATE_SPOT, MANY_NODES, ONE_NODE_OUTAGE

# The catalog's prices per hour of the training node (p4d.24xlarge): spot and on-demand.
NODE_SPOT, NODE = 9.90, 21.96
# One batch of 900 samples at 1 sample/s per worker, 4 spot workers: complete 90 + 225 s in, so
# launched at 330 s (the 30 s grid); 10 minutes of training, 90 s of start-up.
ONE_JOB = Workload(
    batch_samples=900,
    iterations=1,
    workers=4,
    max_workers=4,
    worker_samples_per_hour=3600.0,
    training_minutes=10.0,
    startup_seconds=90.0,
    horizon_days=1.0,
    training_capacity="auto",
)
ROLLOUT = parse_trace("four", {"metadata": {"gap_seconds": 60}, "data": [4]})


def _trace(name: str, data: list[int]) -> SpotTrace:
    return parse_trace(name, {"metadata": {"gap_seconds": 60}, "data": data})


@pytest.mark.parametrize(("notice", "launch"), [(120.0, 480.0), (0.0, 600.0)])
def test_a_job_that_cannot_avoid_a_preemption_pays_one_restart(notice: float, launch: float) -> None:
    # Training nodes for 420 s, then none for 60 s, again and again: no 600 s update fits in one
    # window, so the cheapest job meets one preemption: its start-up, 600 s of update and one
    # restart's start-up (780 s at spot). With the provider's notice it keeps all it did, and
    # starts with a window (480 s): 420 s, the drop at 900 s, a node at 960 s, ready at 1050 s,
    # 180 s more. Without one it keeps its last checkpoint (every 300 s of the attempt), so it
    # starts where its first 300 s end at the drop (600 s): ready again at 1050 s, 300 s more.
    short = _trace("short", [1] * 7 + [0])
    best = oracle(ROLLOUT, replace(ONE_JOB, spot_notice_seconds=notice), training_trace=short)
    (job,) = best.batches
    assert (job.ran, job.training_preemptions, job.launch) == (Ran.WAITED, 1, launch)
    assert best.training_dollars == pytest.approx((90 + 600 + 90) * NODE_SPOT / 3600, abs=1e-4)
    assert job.job_end == pytest.approx(1050.0 + 600 - (900 - launch))


def test_a_job_whose_spot_nodes_go_for_good_switches_to_on_demand_at_its_preemption() -> None:
    # Nodes until 600 s, then none: the job trains 270 s on spot from its launch (330 s), and a
    # new on-demand node takes the 330 s left (waiting never ends; on-demand from the start costs more).
    gone = _trace("gone", [1] * 10 + [0] * 2000)
    best = oracle(ROLLOUT, ONE_JOB, training_trace=gone)
    (job,) = best.batches
    assert (job.ran, job.launch, job.job_end) == (Ran.SWITCHED, 330.0, 600.0 + 90 + 330)
    assert best.training_dollars == pytest.approx(((90 + 270) * NODE_SPOT + (90 + 330) * NODE) / 3600, abs=1e-4)


def test_steady_training_nodes_cost_the_spot_price_and_none_the_on_demand_optimum() -> None:
    # Four spot workers make a batch in 225 s, well within a job: one node held throughout.
    work = replace(ONE_JOB, iterations=3)
    steady = oracle(ROLLOUT, work, training_trace=_trace("steady", [1]))
    assert [b.ran for b in steady.batches] == [Ran.SPOT_NEW, Ran.SPOT_HELD, Ran.SPOT_HELD]
    assert steady.training_dollars == pytest.approx((90 + 3 * 600) * NODE_SPOT / 3600, abs=1e-4)
    assert steady.training_preemptions == 0
    on_demand = oracle(ROLLOUT, replace(work, training_capacity="on-demand"))
    assert on_demand.training_dollars == pytest.approx((90 + 3 * 600) * NODE / 3600, abs=1e-4)
    for no_node in (None, _trace("none", [0])):
        same = oracle(ROLLOUT, work, training_trace=no_node)
        assert (same.dollars, same.wall_seconds, same.batches) == (
            on_demand.dollars,
            on_demand.wall_seconds,
            on_demand.batches,
        )
    # The run spec's on-demand training ignores the training trace.
    assert oracle(ROLLOUT, replace(work, training_capacity="on-demand"), training_trace=_trace("s", [1])) == on_demand


def test_the_training_traces_prices_bill_its_spot_seconds() -> None:
    priced = parse_trace("priced", {"metadata": {"gap_seconds": 60}, "data": [1], "prices": [5.0]})
    best = oracle(ROLLOUT, ONE_JOB, training_trace=priced)
    assert best.training_dollars == pytest.approx((90 + 600) * 5.0 / 3600, abs=1e-4)
    # The lower bound prices training at that trace's cheapest spot tick, as the simulator's does.
    assert best.lower_bound_dollars == pytest.approx(600 * 5.0 / 3600 + 900 * 0.35 / 3600, abs=1e-4)


# The training trace beside each rollout trace, as bench/cost_policies.py pairs them: a zone's
# A100 trace for both pools; none for the g4dn kind (and its own, to meet many nodes).
PAIRS = (
    (ONE_NODE_OUTAGE, ONE_NODE_OUTAGE),
    (FOUR_NODES, FOUR_NODES),
    (LATE_SPOT, LATE_SPOT),
    (MANY_NODES, None),
    (FOUR_NODES, ONE_NODE_OUTAGE),
)
# Every run here ends within 24 h: a 3-day horizon keeps the oracle's grid short.
AUTO = replace(Workload(), training_capacity="auto", horizon_days=3.0)


def _both(pair: tuple[SpotTrace, SpotTrace | None]) -> tuple[OracleResult, OracleResult, SimResult]:
    trace, training = pair
    return (
        oracle(trace, AUTO, training_trace=training),
        oracle(trace, replace(AUTO, training_capacity="on-demand")),
        simulate(trace, CostPolicy.COST_AWARE, AUTO, training_trace=training),
    )


def test_on_traces_of_the_shipped_kinds_spot_training_is_never_dearer_and_the_simulator_never_cheaper() -> None:
    with ProcessPoolExecutor(len(PAIRS)) as pool:
        results = list(pool.map(_both, PAIRS))
    for (trace, training), (best, on_demand, run) in zip(PAIRS, results, strict=True):
        name = f"{trace.name} / {training.name if training else None}"
        assert best.finished and run.finished, name
        assert best.dollars <= on_demand.dollars + 1e-9, name
        assert best.dollars <= run.dollars, name
        assert best.dollars >= best.lower_bound_dollars, name
        assert best.lower_bound_dollars == pytest.approx(run.lower_bound_dollars, abs=1e-3), name
        if training is not None and min(training.available) > 0:  # a node all along: every job on spot
            assert best.spot_jobs == len(best.batches), name
