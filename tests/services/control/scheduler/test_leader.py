"""Two real `spotrl scheduler` processes on one home: one leads, the other stands by and takes over
when the leader is killed mid-run; the run finishes and no pod is launched twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.status import RunStatus
from services.control.scheduler.lease import SCHEDULER_LEASE
from services.core.config import Settings
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodPhase
from services.ports.wiring import Backends, open_backends

pytestmark = pytest.mark.slow

SPEC = RunSpec.model_validate(
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


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """The lease and the run's state in the embedded SQLite file, and in a real PostgreSQL
    (tests/servers/postgres.py), as replicas of the control plane share it in production."""
    if request.param == "sqlite":
        return settings
    return settings.model_copy(update={"state_url": request.getfixturevalue("postgres_url")})


@pytest.fixture
def backends(settings: Settings) -> Iterator[Backends]:
    b = open_backends(settings)
    yield b
    for pod in b.launcher.list():  # nothing of ours is left running
        if pod.phase == PodPhase.RUNNING and pod.pid:
            os.kill(pod.pid, signal.SIGKILL)
    b.close()


@pytest.fixture
def start_scheduler(settings: Settings, tmp_path: Path) -> Iterator:
    env = {
        **os.environ,
        **settings.pod_env(),
        "SPOTRL_TICK_SECONDS": str(settings.tick_seconds),
        "SPOTRL_LEASE_SECONDS": str(settings.lease_seconds),
    }
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "scheduler"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def leader_pid(backends: Backends) -> int | None:
    holder = backends.state.lease_holder(SCHEDULER_LEASE)  # "host:pid:nonce"
    return int(holder.split(":")[1]) if holder else None


def test_standby_takes_over_from_killed_leader_and_launches_nothing_twice(
    backends: Backends, start_scheduler, tmp_path: Path, wait_for, submit
) -> None:
    first = start_scheduler("first")
    wait_for(lambda: leader_pid(backends) == first.pid, timeout_s=60, message="the first scheduler leads")
    second = start_scheduler("second")
    run_id = submit(backends, SPEC)  # at once: the second process starts while the first launches the run's pods
    wait_for(
        lambda: "stands by" in (tmp_path / "second.log").read_text(),
        timeout_s=60,
        message="the second scheduler stands by",
    )
    wait_for(
        lambda: any(p.role == "training" for p in backends.launcher.list(run_id)),
        timeout_s=120,
        message="the first training job was launched",
    )
    first.send_signal(signal.SIGKILL)  # mid-run, with its pods running
    first.wait()

    wait_for(lambda: leader_pid(backends) == second.pid, timeout_s=30, message="the standby took the lease over")
    wait_for(
        lambda: RunStatus(backends.state.get_run(run_id).status).is_terminal(), timeout_s=180, message="the run ended"
    )
    run = backends.state.get_run(run_id)
    assert run.status == RunStatus.SUCCEEDED, run.status_reason
    assert run.iterations_done == 2
    pods = [e.pod for e in backends.state.ledger(run_id)]
    assert len(pods) == len(set(pods)), f"a pod was launched twice: {pods}"
    assert sorted(p for p in pods if "-train-" in p) == [f"{run_id}-train-1", f"{run_id}-train-2"]
    assert backends.state.open_ledger_count(run_id) == 0
    assert backends.launcher.list(run_id) == []

    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0
    assert backends.state.lease_holder(SCHEDULER_LEASE) is None, "a clean stop releases the lease"
