"""A tick's reads of a run do not grow with the run's history: it reads only the last
JOB_SECONDS_WINDOW iterations of a run that has trained many."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from services.control.scheduler.loop import Scheduler
from services.control.scheduler.policies import JOB_SECONDS_WINDOW
from services.core.config import Settings
from services.domain.runspec import RunSpec
from services.ports.state.state_schema import IterationRow
from services.ports.state.state_store import StateStore
from services.ports.wiring import Backends

SPEC = RunSpec.model_validate(
    {
        "model": "tiny",
        "prompts": [{"prompt": "1+1=", "answer": "2"}],
        "samples_per_prompt": 4,
        "batch_samples": 8,
        "iterations": 1000,
        "cost_policy": "cost-aware",  # the policy that reads the jobs' seconds every tick
        "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 2},
    }
)


@contextmanager
def _statements(state: StateStore) -> Iterator[list[str]]:
    statements: list[str] = []

    def execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    event.listen(state._engine, "before_cursor_execute", execute)
    try:
        yield statements
    finally:
        event.remove(state._engine, "before_cursor_execute", execute)


def _iteration(run_id: str, i: int, seconds: float) -> IterationRow:
    return IterationRow(
        run_id=run_id, iteration=i, policy_version=i, mean_reward=0.5, kl=0.0, loss=0.0, seconds=seconds,
        samples_trained=8, samples_dropped=0, metrics={}, ended_at=1000.0 + i,
    )  # fmt: skip


def test_a_tick_reads_a_bounded_window_of_iterations(scripted_backends: Backends, settings: Settings, submit) -> None:
    b = scripted_backends
    run_id = submit(b, SPEC)
    scheduler = Scheduler(b, settings)
    scheduler.tick()  # StartRun
    for i in range(1, 31):
        b.state.record_iteration(_iteration(run_id, i, seconds=float(i)))
    with _statements(b.state) as statements:
        scheduler.tick()
    reads = [s for s in statements if "FROM iterations" in s]
    assert reads, "the tick reads the jobs' seconds"
    assert all("LIMIT" in s for s in reads), reads


def test_recent_job_seconds_are_the_last_ones_oldest_first(scripted_backends: Backends, submit) -> None:
    run_id = submit(scripted_backends, SPEC)
    for i in range(1, 10):
        scripted_backends.state.record_iteration(_iteration(run_id, i, seconds=float(i)))
    assert scripted_backends.state.recent_job_seconds(run_id, JOB_SECONDS_WINDOW) == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert scripted_backends.state.recent_job_seconds(run_id, 20) == [float(i) for i in range(1, 10)]
