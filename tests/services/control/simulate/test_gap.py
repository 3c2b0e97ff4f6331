"""Where a run's dollars above the lower bound go (``services.control.simulate.gap``)."""

from __future__ import annotations

import pytest

from services.control.simulate.gap import PARTS, PodSpan, forced_training_startups, gap
from services.control.simulate.traces import parse_trace
from services.control.simulate.world import Workload, simulate
from services.domain.runspec import CostPolicy

HOURLY_3600 = 3600.0  # $1 a second: seconds read as dollars


def test_each_pods_seconds_go_to_its_start_up_busy_and_idle_parts() -> None:
    pods = [
        PodSpan(rollout=True, started_at=0, ready_at=60, ended_at=400, busy_seconds=300, price_per_hour=HOURLY_3600),
        PodSpan(
            rollout=False, started_at=100, ready_at=190, ended_at=500, busy_seconds=290, price_per_hour=HOURLY_3600
        ),
        # A standby stopped before it was up: all start-up, nothing idle.
        PodSpan(rollout=False, started_at=600, ready_at=690, ended_at=640, busy_seconds=0, price_per_hour=HOURLY_3600),
    ]
    # The bound trained 250 s of rollout and 290 s of training; the provider billed 20 s more.
    parts = gap(pods, dollars=400 + 400 + 40 + 20, rollout_bound=250, training_bound=290)
    assert parts == {
        "train_startup": 90 + 40,
        "train_idle": 20,
        "roll_startup": 60,
        "roll_idle": 40,
        "roll_waste": 50,
        "billing": 20,
    }


@pytest.mark.parametrize("policy", list(CostPolicy))
def test_the_parts_add_up_to_the_runs_dollars_above_the_bound(policy: CostPolicy) -> None:
    # A capacity drop preempts workers (their groups are lost); cost-aware holds and stops standbys.
    trace = parse_trace("short", {"metadata": {"gap_seconds": 60}, "data": [4] * 10 + [1] * 20 + [8] * 200})
    r = simulate(
        trace,
        policy,
        Workload(
            batch_samples=400,
            iterations=3,
            workers=4,
            max_workers=8,
            worker_samples_per_hour=3600.0,
            training_minutes=5.0,
            startup_seconds=90.0,
        ),
    )
    assert set(r.gap) == set(PARTS)
    assert sum(r.gap.values()) == pytest.approx(r.dollars - r.lower_bound_dollars, abs=1e-3)
    assert r.gap["train_startup"] > 0 and r.gap["roll_startup"] > 0
    assert abs(r.gap["billing"]) < 0.01 * (r.dollars - r.lower_bound_dollars)


@pytest.mark.parametrize(
    ("spot_workers", "staleness_bound", "forced"),
    [
        # The bench's GCP zones: a batch in 1500 s against 1080 s of training, 420 s of wait > 90 s:
        # the first job, then one start-up per pair of jobs back to back; none pair with a bound of 0.
        (4, 1, 7),
        (4, 0, 12),
        (6, 1, 1),  # 1000 s per batch: the next one is ready as the job ends, the node stays warm
        (0, 1, 12),
    ],
)
def test_training_start_ups_are_forced_when_the_batch_is_slower_than_the_job_by_more_than_a_start_up(
    spot_workers: int, staleness_bound: int, forced: int
) -> None:
    assert forced_training_startups(12, 5000, spot_workers, 3000 / 3600, 18 * 60, 90, staleness_bound) == forced
