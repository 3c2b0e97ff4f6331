"""A tick's reads do not grow with the runs' history nor, in statements, with their number: it
reads every run's rows in one query a table, and only the last JOB_SECONDS_WINDOW iterations of a
run that has trained many."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from services.control.scheduler.loop import Scheduler
from services.control.scheduler.policies import JOB_SECONDS_WINDOW
from services.core.config import Settings
from services.domain.runspec import RunSpec
from services.ports.state.state_store import StateStore
from services.ports.wiring import Backends
from tests.iteration_rows import iteration_row

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


def test_a_tick_reads_all_runs_at_once_and_a_bounded_window_of_iterations(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b = scripted_backends
    runs = [submit(b, SPEC) for _ in range(3)]
    scheduler = Scheduler(b, settings)
    scheduler.tick()  # StartRun
    for i in range(1, 31):
        b.state.record_iteration(iteration_row(runs[0], i, seconds=float(i)))
    with _statements(b.state) as statements:
        scheduler.tick()

    def reads_by_run(table: str) -> list[str]:  # the table's rows read by run (not a pod's entry by its name)
        return [s for s in statements if f"FROM {table}" in s and "run_id" in s.partition("WHERE")[2]]

    for table in ("iterations", "ledger", "worker_stats"):
        assert len(reads_by_run(table)) == 1, (table, reads_by_run(table))  # one for the three runs
    (iterations,) = reads_by_run("iterations")
    assert "iterations_done" in iterations  # bounded by each run's last iteration


def test_reconcile_reads_are_each_runs_last_job_seconds_oldest_first(scripted_backends: Backends, submit) -> None:
    state = scripted_backends.state
    one, other, fresh = (submit(scripted_backends, SPEC) for _ in range(3))
    for i in range(1, 10):
        state.record_iteration(iteration_row(one, i, seconds=float(i)))
    state.record_iteration(iteration_row(other, 1, seconds=7.0))
    reads = state.reconcile_reads([one, other, fresh], JOB_SECONDS_WINDOW)
    assert reads[one].job_seconds == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert reads[other].job_seconds == [7.0]
    assert reads[fresh].job_seconds == [] and reads[fresh].ledger == [] and reads[fresh].worker_stats == []
    assert state.reconcile_reads([one], 20)[one].job_seconds == [float(i) for i in range(1, 10)]
