"""The loop's error taxonomy: temporary errors back off, permanent ones fail the run, unexpected
ones are logged once and retried. A launcher that raises on cue stands in for a failing cloud."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest

from contracts.status import RunStatus
from services.api import service
from services.backends.launcher import PodSpec, PodStatus
from services.config import Settings
from services.errors import PermanentError, TemporaryError
from services.runspec import RunSpec
from services.scheduler.loop import Scheduler
from services.wiring import Backends, open_backends

SPEC = RunSpec.model_validate({
    "model": "tiny", "prompts": [{"prompt": "1+1=", "answer": "2"}], "samples_per_prompt": 4, "batch_samples": 8,
    "iterations": 1, "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 2},
})


class ScriptedLauncher:
    """Raises ``error`` from ``launch`` while it is set; otherwise records the pod and runs nothing."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.attempts: list[str] = []

    def launch(self, spec: PodSpec) -> None:
        self.attempts.append(spec.name)
        if self.error is not None:
            raise self.error

    def list(self, run_id: str | None = None) -> list[PodStatus]:
        return []

    def stop(self, name: str, grace_s: float) -> None:
        pass

    def delete(self, name: str) -> None:
        pass

    def logs(self, name: str, tail: int = 100) -> str:
        return ""


@pytest.fixture
def backends(settings: Settings) -> Iterator[Backends]:
    b = dataclasses.replace(open_backends(settings), launcher=ScriptedLauncher())
    yield b
    b.close()


@pytest.fixture
def scheduler(backends: Backends, settings: Settings) -> Scheduler:
    return Scheduler(backends, settings)


def started_run(backends: Backends, scheduler: Scheduler) -> str:
    run_id = service.create_run(backends=backends, spec=SPEC).id
    scheduler.tick()  # StartRun: the next tick launches the first worker
    assert backends.state.get_run(run_id).status == RunStatus.RUNNING
    return run_id


def test_temporary_error_backs_off_doubling_and_shows_its_reason(backends: Backends, scheduler: Scheduler,
                                                                 caplog: pytest.LogCaptureFixture, wait_for) -> None:
    launcher: ScriptedLauncher = backends.launcher  # type: ignore[assignment]
    run_id = started_run(backends, scheduler)
    launcher.error = TemporaryError("no spot capacity in us-east-1a", delay=1.0)
    with caplog.at_level(logging.WARNING, logger="services.scheduler.loop"):
        scheduler.tick()
        assert len(launcher.attempts) == 1
        assert service.get_run(backends=backends, run_id=run_id).last_error == "no spot capacity in us-east-1a"
        scheduler.tick()  # within the delay: the run is left alone
        assert len(launcher.attempts) == 1
        wait_for(lambda: scheduler.tick() or len(launcher.attempts) == 2, message="the run was retried after its delay")
    assert [r.getMessage().rsplit("retrying in ", 1)[1] for r in caplog.records] == ["1.0 s", "2.0 s"]
    run = backends.state.get_run(run_id)
    assert (run.status, run.ending_status) == (RunStatus.RUNNING, None)  # retried, never failed

    launcher.error = None
    wait_for(lambda: scheduler.tick() or len(launcher.attempts) == 3, message="the run was retried again")
    assert backends.state.get_run(run_id).last_error is None


def test_permanent_error_fails_the_run_with_its_reason(backends: Backends, scheduler: Scheduler) -> None:
    launcher: ScriptedLauncher = backends.launcher  # type: ignore[assignment]
    run_id = started_run(backends, scheduler)
    launcher.error = PermanentError("instance type g6.xlarge is retired")
    scheduler.tick()
    run = backends.state.get_run(run_id)
    assert (run.status, run.status_reason) == (RunStatus.ENDING, "instance type g6.xlarge is retired")
    scheduler.tick()  # no pods to stop: the run ends
    run = backends.state.get_run(run_id)
    assert (run.status, run.status_reason) == (RunStatus.FAILED, "instance type g6.xlarge is retired")
    assert len(launcher.attempts) == 1


def test_unexpected_error_is_logged_once_per_distinct_error_and_retried_every_tick(
    backends: Backends, scheduler: Scheduler, caplog: pytest.LogCaptureFixture
) -> None:
    launcher: ScriptedLauncher = backends.launcher  # type: ignore[assignment]
    run_id = started_run(backends, scheduler)
    launcher.error = RuntimeError("boom")
    with caplog.at_level(logging.ERROR, logger="services.scheduler.loop"):
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
