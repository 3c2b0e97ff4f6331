"""The scheduler tests' world: runs stored as the API stores them, and a launcher the test plays
the kubelet for (pods it starts run nothing; the test ends them and does their work)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from services.core.config import Settings
from services.domain.names import prompts_key
from services.domain.prompts import to_jsonl
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodPhase, PodSpec, PodStatus
from services.ports.wiring import Backends, open_backends


def submit_run(backends: Backends, spec: RunSpec) -> str:
    """Store a run PENDING with its prompt set beside it, as the API does; returns its id.

    Straight into the stores, so that a spec beyond what the API accepts (a huge batch) can be
    given to the scheduler, which must cope with whatever the state store holds."""
    run_id = f"run-{uuid.uuid4().hex[:10]}"
    prompts = spec.prompts if isinstance(spec.prompts, list) else []
    backends.objects.put_bytes(prompts_key(run_id), to_jsonl(prompts))  # as the API writes them: unicode raw
    backends.state.create_run(run_id, name=spec.name, spec=spec.model_dump(mode="json"))
    return run_id


class ScriptedLauncher:
    """Pods that run nothing: ``launch`` records a Running pod (or raises ``error`` while it is
    set, after starting the pod when ``started_anyway``); the test ends pods with ``end``.

    ``stop`` ends a pod as a SIGTERM would (exit -15), so a stopped job reads Failed."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.started_anyway = False  # the launch raises, yet the pod runs (a create call that timed out)
        self.attempts: list[str] = []
        self.pods: dict[str, PodStatus] = {}
        self.zones: dict[str, str | None] = {}  # the zone each pod was last launched to (PodSpec.zone)
        self.gpus: dict[str, int | None] = {}  # the GPUs each pod was last launched with (PodSpec.gpus)
        self.commands: dict[str, list[str]] = {}  # each running pod's command

    def launch(self, spec: PodSpec) -> None:
        self.attempts.append(spec.name)
        self.zones[spec.name] = spec.zone
        self.gpus[spec.name] = spec.gpus
        if self.error is not None and not self.started_anyway:
            raise self.error
        if spec.name not in self.pods:
            self.pods[spec.name] = PodStatus(
                name=spec.name,
                run_id=spec.run_id,
                role=spec.role,
                instance_type=spec.instance_type,
                capacity_type=spec.capacity_type,
                labels=dict(spec.labels),
                phase=PodPhase.RUNNING,
                exit_code=None,
                started_at=time.time(),
                ended_at=None,
                pid=None,
                nodes=spec.nodes,
            )
        self.commands[spec.name] = spec.command
        if self.error is not None:
            raise self.error

    def end(self, name: str, exit_code: int) -> None:
        phase = PodPhase.SUCCEEDED if exit_code == 0 else PodPhase.FAILED
        self.pods[name] = dataclasses.replace(self.pods[name], phase=phase, exit_code=exit_code, ended_at=time.time())

    def list(self, run_id: str | None = None) -> list[PodStatus]:
        return sorted((p for p in self.pods.values() if run_id is None or p.run_id == run_id), key=lambda p: p.name)

    def running(self, run_id: str, role: str) -> list[PodStatus]:
        return [p for p in self.list(run_id) if p.role == role and p.phase == PodPhase.RUNNING]

    def stop(self, name: str, grace_s: float) -> None:
        if name in self.pods and self.pods[name].phase == PodPhase.RUNNING:
            self.end(name, -15)

    def delete(self, name: str) -> None:
        self.pods.pop(name, None)

    def close(self) -> None:
        pass

    def logs(self, name: str, tail: int = 100) -> str:
        return ""


@pytest.fixture
def submit() -> Callable[[Backends, RunSpec], str]:
    """``submit(backends, spec)``: store a run as the API does (``submit_run``); returns its id."""
    return submit_run


@pytest.fixture
def scripted_backends(settings: Settings) -> Iterator[Backends]:
    """The embedded backends with a ``ScriptedLauncher``: the queue, stores and objects are real."""
    b = dataclasses.replace(open_backends(settings), launcher=ScriptedLauncher())
    yield b
    b.close()
