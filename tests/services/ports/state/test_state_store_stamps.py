"""What the API keeps between reads rests on two stamps of the state store, on both adapters: a
ledger's (``LedgerStamp``) and a run's (``RunStamp``). Each must move with every change of what
it stands for, and a ledger whose stamp the reader knows is not read again."""

from __future__ import annotations

import pytest

from contracts.evaluation import EvalResult
from contracts.status import RunStatus
from services.ports.state.state_store import LedgerStamp, RunNotFoundError, StateStore
from tests.iteration_rows import iteration_row

LEDGER = dict(role="rollout", instance_type="g6.xlarge", capacity_type="spot", price_per_hour=3.6, price_source="test")


def test_a_ledger_stamp_counts_entries_the_newest_and_the_open(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    assert LedgerStamp.of(store.ledger("r1")) == LedgerStamp(0, 0, 0)
    store.open_ledger(run_id="r1", pod="a", started_at=100.0, **LEDGER)
    store.open_ledger(run_id="r1", pod="b", started_at=100.0, **LEDGER)
    store.close_ledger("a", ended_at=110.0)
    entries = store.ledger("r1")
    assert LedgerStamp.of(entries) == LedgerStamp(2, entries[-1].id, 1)
    assert not LedgerStamp.of(entries).closed
    # The store's own stamp of the ledger (what run_view compares) is the same three counts.
    assert store.run_stamp("r1").ledger == LedgerStamp.of(entries)


def test_a_known_closed_ledger_is_not_read_again_until_it_changes(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    store.create_run("r2", name=None, spec={})
    store.open_ledger(run_id="r1", pod="a", started_at=100.0, **LEDGER)
    store.close_ledger("a", ended_at=110.0)
    closed = LedgerStamp.of(store.ledger("r1"))
    known = {"r1": closed, "r2": LedgerStamp(0, 0, 0)}.get

    assert store.run_view("r1", latest=5, known=known).ledger is None
    assert store.run_ledger("r1", known=known)[1] is None
    assert [(r.id, ledger) for r, ledger in store.runs_page(tenant=None, limit=5, after=None, known=known)] == [
        ("r1", None),
        ("r2", None),
    ]
    # Read again once the stamp moves: a new entry (open), then its close (closed, one more entry).
    store.open_ledger(run_id="r1", pod="b", started_at=120.0, **LEDGER)
    assert [e.pod for e in store.run_view("r1", latest=5, known=known).ledger or []] == ["a", "b"]
    store.close_ledger("b", ended_at=130.0)
    assert [e.pod for e in store.run_ledger("r1", known=known)[1] or []] == ["a", "b"]
    # An open ledger is read whatever its stamp: what it costs moves with the time.
    store.open_ledger(run_id="r2", pod="c", started_at=100.0, **LEDGER)
    opened = LedgerStamp.of(store.ledger("r2"))
    assert [e.pod for e in store.runs_page(tenant=None, limit=5, after=None, known={"r2": opened}.get)[1][1] or []] == [
        "c"
    ]


def test_a_run_stamp_moves_with_everything_a_view_shows(store: StateStore) -> None:
    store.create_run("r1", name="n", spec={"training": {"instance_type": "x"}})
    stamps = [store.run_stamp("r1")]

    def moved() -> bool:
        stamps.append(store.run_stamp("r1"))
        return stamps[-1] != stamps[-2]

    assert not moved()  # nothing changed: the same stamp
    store.set_status("r1", RunStatus.RUNNING)
    assert moved()
    store.record_iteration(iteration_row("r1", 1, samples_trained=4, metrics={"actor/loss": 0.1}))
    assert moved()
    store.update_run("r1", last_error="boom")
    assert moved()
    store.count_reward_failures("r1", {"function:timeout": 2}, latest="slow")
    assert moved()
    store.count_reward_failures("r1", {"function:timeout": 1}, latest="slow")
    assert moved()
    store.open_eval("r1", 1, launched_at=1.0)
    assert not moved()  # an eval opened is not shown; recorded, it is
    store.record_eval(
        "r1",
        EvalResult(
            policy_version=1, mean_score=0.5, metrics={"mean": 0.5}, prompts=2, samples=2, seconds=1.0, ended_at=2.0
        ),
    )
    assert moved()
    store.open_ledger(run_id="r1", pod="a", started_at=100.0, **LEDGER)
    assert moved()
    store.defer_ledger("a", started_at=105.0)
    assert not moved() and stamps[-1].ledger.open == 1  # an open ledger is never kept: its stamp need not move
    store.close_ledger("a", ended_at=110.0)
    assert moved()
    view = store.run_view("r1", latest=5)
    assert view.stamp == stamps[-1]
    assert (view.iterations_total, view.reward_failures, [e.policy_version for e in view.evals]) == (
        1,
        {"function:timeout": 3},
        [1],
    )


def test_a_view_is_not_read_while_the_run_stands_at_the_stamp_given(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    stamp = store.run_view("r1", latest=5).stamp
    assert stamp is not None and store.run_view("r1", latest=5, unless_at=stamp) is None
    store.record_iteration(iteration_row("r1", 1, samples_trained=4, metrics={"actor/loss": 0.1}))
    moved = store.run_view("r1", latest=5, unless_at=stamp)
    assert moved is not None and moved.stamp != stamp
    assert (moved.iterations_total, [i.iteration for i in moved.latest]) == (1, [1])
    with pytest.raises(RunNotFoundError):
        store.run_view("nope", latest=5, unless_at=stamp)
