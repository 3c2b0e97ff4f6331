"""Jobs of several training nodes (``training.nodes``) in the simulator and the oracle: every node
billed, all of them started together, on spot all of them taken from the trace and lost with any
one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.control.simulate.oracle import oracle
from services.control.simulate.traces import parse_trace
from services.control.simulate.workload import Workload
from services.control.simulate.world import simulate
from services.domain.runspec import CostPolicy
from tests.services.control.simulate.test_oracle import NODE, SMALL


def _trace(name: str, data: list[int]):
    return parse_trace(name, {"metadata": {"gap_seconds": 150}, "data": data})


ROLLOUT = _trace("rollout", [4] * 100)
# One batch of 400 samples: ready about 220 s in; an 18-minute job (its time on all its nodes).
ONE_JOB = Workload(batch_samples=400, iterations=1)


def test_each_node_of_a_job_is_billed_from_its_launch_to_its_end() -> None:
    one = simulate(ROLLOUT, CostPolicy.THRESHOLD, ONE_JOB)
    two = simulate(ROLLOUT, CostPolicy.THRESHOLD, replace(ONE_JOB, training_nodes=2))
    assert two.samples_trained == one.samples_trained == 400
    assert two.wall_seconds == one.wall_seconds  # the nodes boot at once
    job = ONE_JOB.startup_seconds + ONE_JOB.training_minutes * 60
    assert two.dollars - one.dollars == pytest.approx(job * NODE / 3600, abs=ONE_JOB.tick_seconds * NODE / 3600)
    assert two.lower_bound_dollars - one.lower_bound_dollars == pytest.approx(
        ONE_JOB.training_minutes * 60 * NODE / 3600
    )
    assert two.training_busy_fraction == pytest.approx(one.training_busy_fraction)


def test_a_spot_job_waits_for_all_its_nodes_and_loses_them_with_any_one() -> None:
    spot = replace(ONE_JOB, training_capacity="spot", training_nodes=2)
    steady = simulate(ROLLOUT, CostPolicy.THRESHOLD, spot, training_trace=_trace("two", [2] * 100))
    assert steady.finished and steady.preemptions == 0
    # One node of the two goes at 750 s, mid-job, for 300 s: the job is preempted and resumes.
    cut = simulate(ROLLOUT, CostPolicy.THRESHOLD, spot, training_trace=_trace("drop", [2] * 5 + [1] * 2 + [2] * 93))
    assert (cut.preemptions, cut.samples_trained) == (1, 400)
    assert cut.wall_seconds > steady.wall_seconds + 300
    # A zone of one node never holds the job.
    one_node = simulate(
        ROLLOUT, CostPolicy.THRESHOLD, replace(spot, horizon_days=0.5), training_trace=_trace("one", [1] * 400)
    )
    assert not one_node.finished and one_node.samples_trained == 0


def test_the_oracle_pays_every_node_and_no_policy_is_cheaper() -> None:
    trace = parse_trace("one", {"metadata": {"gap_seconds": 60}, "data": [1] * 10})
    one, two = oracle(trace, SMALL), oracle(trace, replace(SMALL, training_nodes=2))
    # The hand-computed schedule of test_oracle, its node time (two jobs and one start-up) paid twice.
    assert two.dollars - one.dollars == pytest.approx((2 * 600 + 90) * NODE / 3600, abs=1e-3)
    for policy in CostPolicy:
        assert two.dollars <= simulate(trace, policy, replace(SMALL, training_nodes=2)).dollars + 1e-6, policy
