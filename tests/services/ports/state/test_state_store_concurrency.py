"""The state store under contention, on a real PostgreSQL: several stores (as separate API
replicas, schedulers and pods would have) write the same rows at once.

No test depends on timing. Each makes the race happen every time: the test first takes, in a
transaction of its own, the lock that the contenders need (a "gate"), starts them, waits until
PostgreSQL reports each of them waiting for a lock (``pg_stat_activity``), and only then lets
them go. A contender that read before taking its lock has read before the others wrote, so an
implementation without the lock, or with it taken too late, fails these tests on every run.
Where the order of the contenders matters they are started one by one, each after the one
before it waits (PostgreSQL grants a row lock to its waiters in turn).

The races whose outcome does not depend on the contenders' order run on SQLite too. There the
gate is the file's write lock, and a contender counts as waiting once it has sent its first
write statement (seen by a SQLAlchemy event): everything it read, it read before that.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import event, make_url
from sqlalchemy.engine import Engine

from contracts.status import RunStatus
from services.ports.state.migrations import SCRIPT_LOCATION
from services.ports.state.state_store import StateStore
from tests.iteration_rows import iteration_row

CONTENDERS = 4
LEDGER = dict(role="rollout", instance_type="g6.xlarge", capacity_type="spot", price_per_hour=3.6, price_source="test")


WRITES = ("BEGIN IMMEDIATE", "INSERT", "UPDATE", "DELETE")


class Contention:
    """Contenders on one database: each call of ``start`` runs in a thread of its own, with a
    store of its own, and waits at the gate that ``gate`` holds."""

    def __init__(self, adapter: str, url: str, wait_for: Callable[..., object], postgres: Any = None) -> None:
        self.adapter = adapter
        self.postgres = postgres
        self.url = url
        self.database = make_url(url).database
        self.wait_for = wait_for
        self.pool = ThreadPoolExecutor(CONTENDERS * 2, thread_name_prefix="contender")
        self.stores: list[StateStore] = []
        self.futures: list[Future[Any]] = []
        if adapter == "postgresql":
            self.monitor = postgres.connect(self.database)
        else:
            self._writers: set[str] = set()  # contender threads that have sent a write statement
            event.listen(Engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        thread = threading.current_thread().name
        if thread.startswith("contender") and statement.lstrip().upper().startswith(WRITES):
            self._writers.add(thread)

    def store(self) -> StateStore:
        store = StateStore(self.url)
        self.stores.append(store)
        return store

    def waiting(self) -> int:
        """PostgreSQL: sessions on this database waiting for a lock (row, transaction, advisory or
        table). SQLite: contenders that have sent a write statement, which waits for the file."""
        if self.adapter == "sqlite":
            return len(self._writers)
        return self.monitor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'", (self.database,)
        ).fetchone()[0]

    @contextmanager
    def gate(self, *statements: str, release: str = "COMMIT") -> Iterator[None]:
        """Hold what ``statements`` lock, in a transaction that ends (``release``) when the block
        does; on SQLite, the file's write lock."""
        if self.adapter == "sqlite":
            conn = sqlite3.connect(self.database, isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
                conn.execute(release)
            finally:
                conn.close()
            return
        conn = self.postgres.connect(self.database)
        try:
            conn.execute("BEGIN")
            for statement in statements:
                conn.execute(statement)
            yield
            conn.execute(release)
        finally:
            conn.close()

    def start(self, call: Callable[[], Any]) -> None:
        """Start ``call`` and wait until it (and every contender before it) waits at the gate, or
        has finished: a contender that takes no lock runs through, and the test's assertions say so."""
        self.futures.append(self.pool.submit(call))
        started = len(self.futures)
        self.wait_for(
            lambda: self.waiting() + sum(f.done() for f in self.futures) >= started,
            message=f"{started} contenders wait at the gate",
        )

    def outcomes(self) -> list[Any]:
        """Each contender's return value, or the exception it raised."""
        results = []
        for future in self.futures:
            try:
                results.append(future.result(timeout=60))
            except Exception as e:  # reported by the test's assertions
                results.append(e)
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for store in self.stores:
            store.close()
        if self.adapter == "postgresql":
            self.monitor.close()
        else:
            event.remove(Engine, "before_cursor_execute", self._seen)


@pytest.fixture
def contention(request: pytest.FixtureRequest, tmp_path: Path, wait_for) -> Iterator[Contention]:
    """PostgreSQL's, or SQLite's where a test asks for it (``indirect`` parameter)."""
    adapter = getattr(request, "param", "postgresql")
    if adapter == "sqlite":
        c = Contention(adapter, f"sqlite:///{tmp_path / 'state.db'}", wait_for)
    else:
        postgres = request.getfixturevalue("postgres")
        c = Contention(adapter, postgres.new_database(), wait_for, postgres)
    yield c
    c.close()


both_adapters = pytest.mark.parametrize("contention", ["postgresql", "sqlite"], indirect=True)


@both_adapters
def test_same_iteration_recorded_at_once_is_recorded_once(contention: Contention) -> None:
    """Schedulers recording one iteration together (an old leader finishing its tick beside the
    new one): one row, the run's counters advanced once, and no contender fails."""
    _record_one_iteration_at_once(contention)


def test_same_iteration_recorded_at_once_where_the_server_defaults_to_serializable(contention: Contention) -> None:
    """The store's sessions are READ COMMITTED whatever the server's default: under SERIALIZABLE
    a contender that waited for the run's lock would fail with a serialization error."""
    with contention.postgres.connect() as admin:
        admin.execute(f"ALTER DATABASE \"{contention.database}\" SET default_transaction_isolation = 'serializable'")
    _record_one_iteration_at_once(contention)


def _record_one_iteration_at_once(contention: Contention) -> None:
    setup = contention.store()
    setup.create_run("r1", name=None, spec={})
    stores = [contention.store() for _ in range(CONTENDERS)]
    with contention.gate("SELECT 1 FROM runs WHERE id = 'r1' FOR UPDATE"):
        for store in stores:
            contention.start(
                lambda store=store: store.record_iteration(
                    iteration_row("r1", 1, kl=0.01, loss=0.1, seconds=3.0, samples_dropped=2), samples_dropped_extra=1
                )
            )
    assert contention.outcomes() == [None] * CONTENDERS
    run = setup.get_run("r1")
    assert (run.iterations_done, run.policy_version, run.samples_trained, run.samples_dropped) == (1, 1, 8, 3)
    assert [it.iteration for it in setup.iterations("r1")] == [1]


@pytest.mark.parametrize("lease", ["missing", "expired"])
def test_lease_contenders_at_once_get_one_holder(contention: Contention, lease: str) -> None:
    """Schedulers starting together on a store without the lease (all INSERT it), or after its
    holder died (all take the expired lease over): exactly one holds it, and keeps it."""
    setup = contention.store()
    if lease == "expired":
        setup.acquire_lease("scheduler", "dead", seconds=-1.0)
        gate = contention.gate("SELECT 1 FROM leases WHERE name = 'scheduler' FOR UPDATE")
    else:  # an uncommitted lease row: each contender's INSERT waits for the key, then the gate rolls back
        gate = contention.gate(
            "INSERT INTO leases (name, holder, expires_at) VALUES ('scheduler', 'gate', 0)", release="ROLLBACK"
        )
    stores = [contention.store() for _ in range(CONTENDERS)]
    with gate:
        for i, store in enumerate(stores):
            contention.start(lambda i=i, store=store: store.acquire_lease("scheduler", f"holder-{i}", seconds=60))
    outcomes = contention.outcomes()
    assert all(isinstance(o, bool) for o in outcomes), outcomes  # the losers are told, not failed
    won = [i for i, outcome in enumerate(outcomes) if outcome]
    assert len(won) == 1, outcomes
    (winner,) = won
    assert setup.lease_holder("scheduler") == f"holder-{winner}"
    # Still one holder: the others' next tries fail, the winner's renewal succeeds.
    assert [stores[i].acquire_lease("scheduler", f"holder-{i}", seconds=60) for i in range(CONTENDERS)] == [
        i == winner for i in range(CONTENDERS)
    ]


@pytest.mark.parametrize(
    "first, second, expected",
    [
        # A failure replaces a cancel that came first, and a cancel after a failure changes nothing.
        (("begin_ending", RunStatus.FAILED, "broken"), ("request_cancel",), ("ENDING", "FAILED", "broken")),
        # The first decision stands: an end condition met after a cancel changes nothing.
        (
            ("request_cancel",),
            ("begin_ending", RunStatus.SUCCEEDED, "done"),
            ("CANCELLING", "CANCELLED", "cancelled by the user"),
        ),
    ],
    ids=["failure-then-cancel", "cancel-then-success"],
)
def test_status_decisions_at_once_are_not_lost(
    contention: Contention, first: tuple, second: tuple, expected: tuple
) -> None:
    """An API replica cancels while a scheduler ends the run and another updates its counters:
    each decides on what the one before it wrote, so the status that stands is the one the rules
    say (``_begin_ending``), whatever the second read before the first committed."""
    setup = contention.store()
    setup.create_run("r1", name=None, spec={})
    setup.set_status("r1", RunStatus.RUNNING)
    a, b, c = (contention.store() for _ in range(3))
    with contention.gate("SELECT 1 FROM runs WHERE id = 'r1' FOR UPDATE"):
        contention.start(lambda: getattr(a, first[0])("r1", *first[1:]))
        contention.start(lambda: getattr(b, second[0])("r1", *second[1:]))
        contention.start(lambda: c.update_run("r1", last_error="slow queue", worker_slots_used=2))
    assert not [o for o in contention.outcomes() if isinstance(o, Exception)], contention.outcomes()
    run = setup.get_run("r1")
    assert (run.status, run.ending_status, run.ending_reason) == expected
    assert (run.last_error, run.worker_slots_used) == ("slow queue", 2)


@both_adapters
def test_same_pod_opened_at_once_has_one_open_entry(contention: Contention) -> None:
    """Two schedulers billing the same new pod at once open one ledger entry, not two."""
    setup = contention.store()
    setup.create_run("r1", name=None, spec={})
    stores = [contention.store() for _ in range(CONTENDERS)]
    with contention.gate("SELECT 1 FROM runs WHERE id = 'r1' FOR UPDATE"):
        for i, store in enumerate(stores):
            contention.start(
                lambda i=i, store=store: store.open_ledger(
                    run_id="r1", pod="r1-rollout-0", started_at=100.0 + i, **LEDGER
                )
            )
    assert contention.outcomes() == [None] * CONTENDERS
    assert setup.open_ledger_count("r1") == 1
    (entry,) = setup.ledger("r1")  # whichever came first
    assert entry.started_at in {100.0 + i for i in range(CONTENDERS)}


def test_pod_closed_at_once_keeps_the_first_end(contention: Contention) -> None:
    """Closing a closed pod changes nothing, also when the closes come at once."""
    setup = contention.store()
    setup.create_run("r1", name=None, spec={})
    setup.open_ledger(run_id="r1", pod="p1", started_at=100.0, **LEDGER)
    first, second = contention.store(), contention.store()
    with contention.gate("SELECT 1 FROM ledger WHERE pod = 'p1' FOR UPDATE"):
        contention.start(lambda: first.close_ledger("p1", ended_at=150.0))
        contention.start(lambda: second.close_ledger("p1", ended_at=190.0))
    assert contention.outcomes() == [None, None]
    assert [e.ended_at for e in setup.ledger("r1")] == [150.0]


def test_stores_opened_at_once_on_a_new_database_migrate_it_once(contention: Contention) -> None:
    """API replicas and schedulers starting together on an empty database: every one opens, and
    the schema is migrated once. The gate creates Alembic's version table and rolls it back: each
    contender that reaches its own CREATE of that table waits for the gate's, and without the
    migration lock all of them would, then race to create it."""
    with contention.gate("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)", release="ROLLBACK"):
        for _ in range(CONTENDERS):
            contention.start(contention.store)
    outcomes = contention.outcomes()
    assert all(isinstance(o, StateStore) for o in outcomes), outcomes
    with contention.postgres.connect(contention.database) as conn:
        versions = [v for (v,) in conn.execute("SELECT version_num FROM alembic_version")]
    assert versions == [ScriptDirectory(SCRIPT_LOCATION).get_current_head()]
