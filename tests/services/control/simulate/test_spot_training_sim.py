"""Spot training in the simulator: jobs on the training trace's nodes, preempted at its drops and
resumed from their checkpoint; auto falling back to on-demand where no spot node comes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from services.control.scheduler.spot_training import SPOT_RETRY_AFTER_SECONDS
from services.control.simulate.traces import parse_trace
from services.control.simulate.workload import Workload
from services.control.simulate.world import simulate
from services.domain.runspec import CostPolicy
from tests.services.control.simulate.trace_shapes import FOUR_NODES, MANY_NODES


def _trace(name: str, data: list[int]):
    return parse_trace(name, {"metadata": {"gap_seconds": 150}, "data": data})


ROLLOUT = _trace("rollout", [4] * 100)
STEADY = _trace("steady", [1] * 100)
# The training node goes at 750 s, mid-job (the job runs from about 310 s to 1390 s), for 300 s.
OUTAGE = _trace("outage", [1] * 5 + [0] * 2 + [1] * 93)
# One batch of 400 samples: ready about 220 s in; an 18-minute job.
ONE_JOB = Workload(batch_samples=400, iterations=1, training_capacity="spot")


@pytest.mark.parametrize(("notice", "lost"), [(120.0, 0.0), (0.0, 440.0 - 300.0)])
def test_a_preempted_job_resumes_from_its_checkpoint(notice: float, lost: float) -> None:
    """With the provider's notice the job checkpoints all it did; without one it keeps its last
    periodic checkpoint (every 300 s: 300 of its 440 s). Either way the run ends later by the
    outage, a start-up and what was lost, not by the whole update again."""
    work = replace(ONE_JOB, spot_notice_seconds=notice)
    steady = simulate(ROLLOUT, CostPolicy.THRESHOLD, work, training_trace=STEADY)
    cut = simulate(ROLLOUT, CostPolicy.THRESHOLD, work, training_trace=OUTAGE)
    assert (steady.preemptions, cut.preemptions) == (0, 1)
    assert cut.samples_trained == steady.samples_trained == 400
    outage, startup = 300.0, work.startup_seconds
    assert cut.wall_seconds - steady.wall_seconds == pytest.approx(outage + startup + lost, abs=work.tick_seconds)
    # Both attempts billed: the first up to its preemption, the second from its node.
    spot_per_s = 9.90 / 3600  # p4d.24xlarge spot in the catalog
    assert cut.dollars - steady.dollars == pytest.approx((startup + lost) * spot_per_s, abs=20 * spot_per_s)
    # Where they go (--explain): each attempt's own start-up, and the update lost as training work
    # that was not a trained batch.
    assert cut.gap["train_startup"] == pytest.approx(2 * steady.gap["train_startup"])
    assert cut.gap["billing"] - steady.gap["billing"] == pytest.approx(lost * spot_per_s, abs=1e-6)


def test_spot_training_halves_the_bill_where_spot_nodes_are_steady() -> None:
    on_demand = simulate(FOUR_NODES, CostPolicy.COST_AWARE, Workload(), training_trace=STEADY)
    for capacity in ("spot", "auto"):
        spot = simulate(
            FOUR_NODES, CostPolicy.COST_AWARE, replace(Workload(), training_capacity=capacity), training_trace=STEADY
        )
        assert spot.samples_trained == on_demand.samples_trained
        assert spot.dollars < 0.6 * on_demand.dollars
        assert spot.wall_seconds <= 1.01 * on_demand.wall_seconds
        # Its lower bound prices training at spot, and the bill stays above it.
        assert spot.lower_bound_dollars < 0.6 * on_demand.lower_bound_dollars
        assert spot.dollars >= spot.lower_bound_dollars


def test_auto_trains_on_demand_where_no_spot_node_comes_and_spot_waits() -> None:
    on_demand = simulate(MANY_NODES, CostPolicy.COST_AWARE, Workload())
    auto = simulate(MANY_NODES, CostPolicy.COST_AWARE, replace(Workload(), training_capacity="auto"))
    assert auto.finished and auto.samples_trained == on_demand.samples_trained
    # Each give-up costs two start-ups of waiting; it is tried again only every two hours.
    assert auto.dollars <= 1.03 * on_demand.dollars
    assert auto.wall_seconds <= 1.05 * on_demand.wall_seconds
    spot = simulate(MANY_NODES, CostPolicy.COST_AWARE, replace(Workload(), training_capacity="spot", horizon_days=1))
    assert not spot.finished and spot.samples_trained == 0


def test_a_job_no_node_comes_for_moves_to_the_next_zone() -> None:
    """Two spot zones, the cheaper (by the trace's price) without nodes: the job waits its patience
    there, then trains on spot in the other zone, at about the steady zone's bill; one zone alone
    without nodes leaves auto on-demand."""
    priced = {"metadata": {"gap_seconds": 150}}
    dry = parse_trace("dry", {**priced, "data": [0] * 100, "prices": [8.0] * 100})
    wet = parse_trace("wet", {**priced, "data": [1] * 100, "prices": [9.9] * 100})
    auto = replace(Workload(), training_capacity="auto")
    steady = simulate(FOUR_NODES, CostPolicy.COST_AWARE, auto, training_trace=wet)
    zones = simulate(FOUR_NODES, CostPolicy.COST_AWARE, auto, training_trace=[dry, wet])
    alone = simulate(FOUR_NODES, CostPolicy.COST_AWARE, auto, training_trace=dry)
    assert zones.samples_trained == steady.samples_trained == alone.samples_trained
    # The dry zone is tried again every 2 h: each try waits a patience (two start-ups), billed at
    # most a boot and a step (services.control.scheduler.ledger_match), while the batch waits.
    tries = math.ceil(steady.wall_seconds / SPOT_RETRY_AFTER_SECONDS)
    assert zones.wall_seconds <= steady.wall_seconds + tries * 2 * auto.startup_seconds
    assert zones.dollars < 0.6 * alone.dollars
    assert zones.dollars <= 1.05 * steady.dollars
