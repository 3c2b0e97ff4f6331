"""The reconcile loop with spot training, on the embedded stores and queue (a launcher the test
plays the kubelet for): a spot job is launched and billed on spot, a preempted one is started again
with no failure counted and both attempts billed; auto tries each spot zone, then trains on-demand."""

from __future__ import annotations

import dataclasses
import time

import pytest

from contracts.status import RunStatus
from services.control.scheduler.loop import Scheduler
from services.control.scheduler.spot_training import PATIENCE_STARTUPS
from services.core.config import Settings
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodOutcome, PodPhase
from services.ports.wiring import Backends
from tests.services.control.scheduler.test_accounting import produce


def spec(capacity: str) -> RunSpec:
    return RunSpec.model_validate(
        {
            "model": "tiny",
            "prompts": [{"prompt": "1+1=", "answer": "2"}],
            "samples_per_prompt": 4,
            "batch_samples": 8,
            "iterations": 1,
            "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 2},
            "training": {"capacity": capacity},
        }
    )


@pytest.fixture
def scheduler(scripted_backends: Backends, settings: Settings) -> Scheduler:
    return Scheduler(scripted_backends, settings)


def _job_launched(scheduler: Scheduler, b: Backends, run_id: str, capacity: str) -> str:
    """Tick until the run's training job is launched (its batch queued); its name."""
    scheduler.tick()  # started
    produce(b, run_id, 2)  # one batch of two groups
    for _ in range(5):
        scheduler.tick()
        jobs = b.launcher.running(run_id, "training")
        if jobs:
            assert [j.capacity_type for j in jobs] == [capacity]
            return jobs[0].name
    raise AssertionError("no training job was launched")


def test_a_preempted_spot_job_starts_again_and_both_attempts_are_billed(
    scripted_backends: Backends, scheduler: Scheduler, submit
) -> None:
    b = scripted_backends
    run_id = submit(b, spec("spot"))
    job = _job_launched(scheduler, b, run_id, "spot")
    launcher = b.launcher
    launcher.end(job, -9)
    launcher.pods[job] = dataclasses.replace(launcher.pods[job], preempted=True)  # its node taken back
    scheduler.tick()  # reaped
    run = b.state.get_run(run_id)
    assert (run.train_failures, run.next_train_at) == (0, 0.0)  # no failure, no backoff
    scheduler.tick()  # the same iteration again, on spot
    assert [(p.name, p.capacity_type) for p in launcher.running(run_id, "training")] == [(job, "spot")]
    entries = [e for e in b.state.ledger(run_id) if e.pod == job]
    assert [(e.capacity_type, e.outcome) for e in entries] == [("spot", PodOutcome.PREEMPTED.value), ("spot", None)]
    assert entries[0].price_per_hour == 9.90  # p4d.24xlarge spot in the catalog


def test_auto_tries_each_spot_zone_then_trains_on_demand(
    scripted_backends: Backends, scheduler: Scheduler, submit
) -> None:
    """A spot job that gets no node within its patience is stopped, its zone given up (stored), and
    the next job goes to the next zone; once both are given up the job goes on-demand, in any zone."""
    b = scripted_backends
    zoned = spec("auto")
    zoned = zoned.model_copy(
        update={"training": zoned.training.model_copy(update={"spot_zones": ["zone-a", "zone-b"]})}
    )
    run_id = submit(b, zoned)
    job = _job_launched(scheduler, b, run_id, "spot")  # spot's price is the lower, no preemption yet
    launcher = b.launcher
    waited = PATIENCE_STARTUPS * 90.0 + 1
    given_up = []
    for zone in ("zone-a", "zone-b"):
        assert launcher.zones[job] == zone
        launcher.pods[job] = dataclasses.replace(
            launcher.pods[job], waiting_for_node=True, started_at=time.time() - waited
        )
        scheduler.tick()  # stopped, and its zone's refusal stored
        assert launcher.pods[job].phase == PodPhase.FAILED
        given_up.append(zone)
        refusals = b.state.get_run(run_id).spot_training_refusals
        assert sorted(refusals) == given_up
        assert refusals[zone] == pytest.approx(time.time(), abs=30)
        scheduler.tick()  # reaped: no failure counted
        assert b.state.get_run(run_id).train_failures == 0
        scheduler.tick()
    assert [(p.name, p.capacity_type) for p in launcher.running(run_id, "training")] == [(job, "on-demand")]
    assert launcher.zones[job] is None
    assert b.state.get_run(run_id).status == RunStatus.RUNNING
