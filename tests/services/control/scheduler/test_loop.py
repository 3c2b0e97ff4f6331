"""The reconcile loop with real pods (tiny model): a restarted scheduler resumes without duplicates."""

from __future__ import annotations

import time

import pytest

from contracts.status import RunStatus
from services.control.scheduler.loop import Scheduler
from services.core.config import Settings
from services.domain.runspec import RunSpec
from services.ports.wiring import open_backends

pytestmark = pytest.mark.slow


def test_restarted_scheduler_resumes_and_launches_nothing_twice(settings: Settings, submit) -> None:
    spec = RunSpec.model_validate(
        {
            "model": "tiny",
            "prompts": [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)],
            "samples_per_prompt": 4,
            "sampling": {"max_new_tokens": 6},
            "batch_samples": 8,
            "iterations": 2,
            "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 2},
        }
    )
    first = open_backends(settings)
    run_id = submit(first, spec)
    scheduler = Scheduler(first, settings)
    deadline = time.monotonic() + 120
    while not any(p.role == "training" for p in first.launcher.list(run_id)):  # until training 1 is launched
        assert time.monotonic() < deadline
        scheduler.tick()
        time.sleep(0.2)
    first.close()  # the scheduler process "dies" here; its pods keep running

    second = open_backends(settings)  # a new process: new clients, new launcher, state from disk
    try:
        restarted = Scheduler(second, settings)
        while not RunStatus(second.state.get_run(run_id).status).is_terminal():
            assert time.monotonic() < deadline, second.state.get_run(run_id).status
            restarted.tick()
            time.sleep(0.2)
        run = second.state.get_run(run_id)
        assert run.status == RunStatus.SUCCEEDED, run.status_reason
        assert run.iterations_done == 2
        pods = [e.pod for e in second.state.ledger(run_id)]
        assert sorted(p for p in pods if "-train-" in p) == [f"{run_id}-train-1", f"{run_id}-train-2"]
        assert len(pods) == len(set(pods)), "a pod was launched twice"
        assert second.state.open_ledger_count(run_id) == 0
        assert second.launcher.list(run_id) == []
    finally:
        second.close()
