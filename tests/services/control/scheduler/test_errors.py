"""The loop's error taxonomy: temporary errors back off, permanent ones fail the run, unexpected
ones are logged once and retried. A launcher that raises on cue stands in for a failing cloud."""

from __future__ import annotations

import logging

import pytest

from contracts.status import RunStatus
from services.control.scheduler.loop import Scheduler
from services.core.config import Settings
from services.core.errors import PermanentError, TemporaryError
from services.domain.runspec import RunSpec
from services.ports.wiring import Backends

SPEC = RunSpec.model_validate(
    {
        "model": "tiny",
        "prompts": [{"prompt": "1+1=", "answer": "2"}],
        "samples_per_prompt": 4,
        "batch_samples": 8,
        "iterations": 1,
        "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 2},
    }
)


@pytest.fixture
def backends(scripted_backends: Backends) -> Backends:
    return scripted_backends  # its launcher: conftest.ScriptedLauncher


@pytest.fixture
def scheduler(backends: Backends, settings: Settings) -> Scheduler:
    return Scheduler(backends, settings)


@pytest.fixture
def run_id(backends: Backends, scheduler: Scheduler, submit) -> str:
    """A started run: the next tick launches its first worker."""
    run_id = submit(backends, SPEC)
    scheduler.tick()  # StartRun: the next tick launches the first worker
    assert backends.state.get_run(run_id).status == RunStatus.RUNNING
    return run_id


def test_temporary_error_backs_off_doubling_and_shows_its_reason(
    backends: Backends, scheduler: Scheduler, run_id: str, caplog: pytest.LogCaptureFixture, wait_for
) -> None:
    launcher = backends.launcher
    launcher.error = TemporaryError("no spot capacity in us-east-1a", delay=1.0)
    with caplog.at_level(logging.WARNING, logger="services.control.scheduler.loop"):
        scheduler.tick()
        assert len(launcher.attempts) == 1
        assert backends.state.get_run(run_id).last_error == "no spot capacity in us-east-1a"
        scheduler.tick()  # within the delay: the run is left alone
        assert len(launcher.attempts) == 1
        wait_for(lambda: scheduler.tick() or len(launcher.attempts) == 2, message="the run was retried after its delay")
    assert [r.getMessage().rsplit("retrying in ", 1)[1] for r in caplog.records] == ["1.0 s", "2.0 s"]
    run = backends.state.get_run(run_id)
    assert (run.status, run.ending_status) == (RunStatus.RUNNING, None)  # retried, never failed

    launcher.error = None
    wait_for(lambda: scheduler.tick() or len(launcher.attempts) == 3, message="the run was retried again")
    assert backends.state.get_run(run_id).last_error is None


def test_permanent_error_fails_the_run_with_its_reason(backends: Backends, scheduler: Scheduler, run_id: str) -> None:
    launcher = backends.launcher
    launcher.error = PermanentError("instance type g6.xlarge is retired")
    scheduler.tick()
    run = backends.state.get_run(run_id)
    assert (run.status, run.status_reason) == (RunStatus.ENDING, "instance type g6.xlarge is retired")
    scheduler.tick()  # no pods to stop: the run ends
    run = backends.state.get_run(run_id)
    assert (run.status, run.status_reason) == (RunStatus.FAILED, "instance type g6.xlarge is retired")
    assert len(launcher.attempts) == 1


def test_unexpected_error_is_logged_once_per_distinct_error_and_retried_every_tick(
    backends: Backends, scheduler: Scheduler, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = backends.launcher
    launcher.error = RuntimeError("boom")
    with caplog.at_level(logging.ERROR, logger="services.control.scheduler.loop"):
        for _ in range(3):
            scheduler.tick()
        launcher.error = OSError("disk full")
        for _ in range(2):
            scheduler.tick()
    assert len(launcher.attempts) == 5  # no backoff
    logged = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert [repr(e) for e in logged] == ["RuntimeError('boom')", "OSError('disk full')"]
    assert backends.state.get_run(run_id).last_error == "OSError: disk full"

    launcher.error = None
    scheduler.tick()
    assert backends.state.get_run(run_id).last_error is None


def test_a_stop_the_plan_repeats_until_the_pod_ends_is_logged_once(
    backends: Backends,
    scheduler: Scheduler,
    run_id: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scheduler.tick()  # launches the worker
    (worker,) = backends.launcher.running(run_id, "rollout")
    monkeypatch.setattr(backends.launcher, "stop", lambda name, grace_s: None)  # it takes its grace period to end
    backends.state.request_cancel(run_id)
    with caplog.at_level(logging.INFO, logger="services.control.scheduler.loop"):
        for _ in range(4):
            scheduler.tick()  # StopPod each tick: level-triggered
        backends.launcher.end(worker.name, -15)
        scheduler.tick()
    stops = [r.getMessage() for r in caplog.records if f"stop {worker.name}" in r.getMessage()]
    assert len(stops) == 1, stops


def test_a_run_cancelled_while_its_start_is_applied_is_no_error(
    backends: Backends, scheduler: Scheduler, submit, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick read the run PENDING; the user cancelled it before the tick started it."""
    run_id = submit(backends, SPEC)
    create_topic = backends.queue.create_topic

    def cancelled_meanwhile(topic: str, partitions: int) -> None:
        create_topic(topic, partitions)
        if backends.state.get_run(run_id).status == RunStatus.PENDING:
            backends.state.request_cancel(run_id)

    monkeypatch.setattr(backends.queue, "create_topic", cancelled_meanwhile)
    with caplog.at_level(logging.INFO, logger="services.control.scheduler"):
        scheduler.tick()
        scheduler.tick()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "cancelled before it started" in caplog.text
    assert backends.state.get_run(run_id).status == RunStatus.CANCELLED
