"""The trackers' cursors in the state store, on both adapters: SQLite and a real PostgreSQL server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.status import RunStatus
from services.ports.state.state_store import StateStore
from tests.services.control.tracking.tracking_support import end_run, make_run


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    url = (
        f"sqlite:///{tmp_path / 'state.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres").new_database()
    )
    s = StateStore(url)
    yield s
    s.close()


def test_a_cursor_only_moves_forward(any_store: StateStore) -> None:
    make_run(any_store, "r1")
    assert any_store.tracking_cursors("r1") == {}
    any_store.advance_tracking_cursor("r1", "mlflow", iteration=3, eval_version=-1)
    any_store.advance_tracking_cursor("r1", "tensorboard", iteration=5, eval_version=2)
    any_store.advance_tracking_cursor("r1", "mlflow", iteration=2, eval_version=1)  # an old leader's late write
    cursors = {name: (c.iteration, c.eval_version, c.ended) for name, c in any_store.tracking_cursors("r1").items()}
    assert cursors == {"mlflow": (3, 1, False), "tensorboard": (5, 2, False)}
    any_store.advance_tracking_cursor("r1", "mlflow", iteration=4, eval_version=1, ended=True)
    any_store.advance_tracking_cursor("r1", "mlflow", iteration=4, eval_version=1)  # ended stays ended
    c = any_store.tracking_cursors("r1")["mlflow"]
    assert (c.iteration, c.ended) == (4, True)


def test_ended_runs_with_a_tracker_not_told_are_listed(any_store: StateStore) -> None:
    for run_id in ("a", "b", "c", "d"):
        make_run(any_store, run_id)
    for run_id in ("a", "b", "c"):
        any_store.advance_tracking_cursor(run_id, "tensorboard", iteration=0, eval_version=-1)
    any_store.advance_tracking_cursor("b", "mlflow", iteration=0, eval_version=-1)
    assert any_store.runs_with_tracking_to_end(10) == []  # none ended yet
    end_run(any_store, "c", RunStatus.FAILED)
    end_run(any_store, "b")
    end_run(any_store, "d")  # tracked by nothing
    assert any_store.runs_with_tracking_to_end(10) == ["c", "b"]  # oldest end first
    assert any_store.runs_with_tracking_to_end(1) == ["c"]
    any_store.advance_tracking_cursor("b", "tensorboard", iteration=0, eval_version=-1, ended=True)
    assert any_store.runs_with_tracking_to_end(10) == ["c", "b"]  # mlflow has not been told yet
    any_store.advance_tracking_cursor("b", "mlflow", iteration=0, eval_version=-1, ended=True)
    assert any_store.runs_with_tracking_to_end(10) == ["c"]


def test_iterations_after_a_cursor(any_store: StateStore) -> None:
    make_run(any_store, "r1", iterations=5)
    assert [r.iteration for r in any_store.iterations("r1", after=2)] == [3, 4, 5]
    assert [r.iteration for r in any_store.iterations("r1", after=1, limit=2)] == [2, 3]
    assert [r.iteration for r in any_store.iterations("r1")] == [1, 2, 3, 4, 5]
