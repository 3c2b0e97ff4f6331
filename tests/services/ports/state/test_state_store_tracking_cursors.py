"""The trackers' cursors in the state store, on both adapters: SQLite and a real PostgreSQL server."""

from __future__ import annotations

from contracts.status import RunStatus
from services.ports.state.state_store import StateStore
from tests.services.control.tracking.tracking_support import end_run, make_run


def test_a_cursor_only_moves_forward(store: StateStore) -> None:
    make_run(store, "r1")
    assert store.tracking_cursors("r1") == {}
    store.advance_tracking_cursor("r1", "mlflow", iteration=3, eval_version=-1)
    store.advance_tracking_cursor("r1", "tensorboard", iteration=5, eval_version=2)
    store.advance_tracking_cursor("r1", "mlflow", iteration=2, eval_version=1)  # an old leader's late write
    cursors = {name: (c.iteration, c.eval_version, c.ended) for name, c in store.tracking_cursors("r1").items()}
    assert cursors == {"mlflow": (3, 1, False), "tensorboard": (5, 2, False)}
    store.advance_tracking_cursor("r1", "mlflow", iteration=4, eval_version=1, ended=True)
    store.advance_tracking_cursor("r1", "mlflow", iteration=4, eval_version=1)  # ended stays ended
    c = store.tracking_cursors("r1")["mlflow"]
    assert (c.iteration, c.ended) == (4, True)


def test_ended_runs_with_a_tracker_not_told_are_listed(store: StateStore) -> None:
    for run_id in ("a", "b", "c", "d"):
        make_run(store, run_id)
    for run_id in ("a", "b", "c"):
        store.advance_tracking_cursor(run_id, "tensorboard", iteration=0, eval_version=-1)
    store.advance_tracking_cursor("b", "mlflow", iteration=0, eval_version=-1)
    assert store.runs_with_tracking_to_end(10) == []  # none ended yet
    end_run(store, "c", RunStatus.FAILED)
    end_run(store, "b")
    end_run(store, "d")  # tracked by nothing
    assert store.runs_with_tracking_to_end(10) == ["c", "b"]  # oldest end first
    assert store.runs_with_tracking_to_end(1) == ["c"]
    store.advance_tracking_cursor("b", "tensorboard", iteration=0, eval_version=-1, ended=True)
    assert store.runs_with_tracking_to_end(10) == ["c", "b"]  # mlflow has not been told yet
    store.advance_tracking_cursor("b", "mlflow", iteration=0, eval_version=-1, ended=True)
    assert store.runs_with_tracking_to_end(10) == ["c"]


def test_iterations_after_a_cursor(store: StateStore) -> None:
    make_run(store, "r1", iterations=5)
    assert [r.iteration for r in store.iterations("r1", after=2)] == [3, 4, 5]
    assert [r.iteration for r in store.iterations("r1", after=1, limit=2)] == [2, 3]
    assert [r.iteration for r in store.iterations("r1")] == [1, 2, 3, 4, 5]
