"""The state store's Alembic revisions, on SQLite and PostgreSQL (a real server,
tests/servers/postgres.py): a store left at any earlier revision, holding rows valid then, is
upgraded to head with every row kept; a store made by the earlier hand-rolled migrations is
adopted; and the head schema is exactly the models' (so a model change without its revision fails)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    JSON,
    Boolean,
    column,
    create_engine,
    func,
    inspect,
    make_url,
    select,
    table,
    text,
)
from sqlalchemy.engine import Connection, Engine

from contracts.status import RunStatus
from services.ports.state.migrations import SCRIPT_LOCATION, alembic_config
from services.ports.state.state_engine import WRITE_OPTION, create_state_engine
from services.ports.state.state_schema import Base, EvalRow, TrackingCursorRow
from services.ports.state.state_store import StateStore

HEAD = ScriptDirectory(SCRIPT_LOCATION).get_current_head()
REVISIONS = [r.revision for r in reversed(list(ScriptDirectory(SCRIPT_LOCATION).walk_revisions()))]
# The tables each revision adds, beside runs, iterations and ledger (0001's).
TABLE_REVISIONS = {
    "leases": 2,
    "worker_stats": 5,
    "reward_failures": 7,
    "tracking_cursors": 8,
    "evals": 9,
    "pod_memory": 10,
}


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    """The store's own writing engine (SQLite pragmas and write lock included)."""
    e = create_state_engine(make_url(store_url))
    yield e.execution_options(**{WRITE_OPTION: True})
    e.dispose()


def _upgrade(engine: Engine, revision: str) -> None:
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), revision)


def _insert(conn: Connection, table_name: str, /, **values: Any) -> None:
    """INSERT one row; dicts travel as JSON and bools as booleans, whatever the adapter."""

    def typed(key: str, value: Any) -> Any:
        return (
            column(key, JSON)
            if isinstance(value, dict)
            else column(key, Boolean)
            if isinstance(value, bool)
            else column(key)
        )

    conn.execute(table(table_name, *(typed(k, v) for k, v in values.items())).insert().values(**values))


def _fill(conn: Connection, at: int) -> None:
    """A run and one related row in each table that revision ``at`` has, with only the columns it has.
    At 0001 the run is stopping by its ``cancel_requested`` flag, as runs were then."""
    counters = dict(
        policy_version=1,
        iterations_done=1,
        prompts_published=8,
        samples_produced=16,
        samples_trained=16,
        samples_dropped=0,
        train_failures=0,
        next_train_at=0.0,
        worker_slots_used=1,
        train_launch_committed=0,
    )
    run = dict(
        id="r1",
        name="n",
        spec={"model": "tiny"},
        status="RUNNING",
        created_at=1.5,
        started_at=2.5,
        **counters,
    )
    if at == 1:
        run["cancel_requested"] = True
    if at in (12, 13):  # a run that gave its spot training node up, as one time then
        run["spot_training_refused_at"] = 7.5
    _insert(conn, "runs", **run)
    _insert(
        conn,
        "iterations",
        run_id="r1",
        iteration=1,
        policy_version=1,
        mean_reward=0.5,
        kl=0.1,
        loss=0.2,
        seconds=3.0,
        samples_trained=16,
        samples_dropped=0,
        metrics={"actor/pg_loss": 0.2},
        ended_at=4.5,
    )
    _insert(
        conn,
        "ledger",
        run_id="r1",
        role="rollout",
        pod="r1-rollout-0",
        instance_type="g6.xlarge",
        capacity_type="spot",
        price_per_hour=3.6,
        price_source="test",
        started_at=2.0,
        ended_at=5.0,
    )
    rows: dict[str, dict[str, Any]] = {
        "leases": dict(name="scheduler", holder="a", expires_at=9.0),
        "worker_stats": dict(
            run_id="r1",
            worker="r1-rollout-0",
            samples_produced=16,
            generation_seconds=1.0,
            reward_cache_hits=1,
            reward_cache_misses=2,
            reward_cache_errors=0,
            reported_at=3.0,
        ),
        "reward_failures": dict(run_id="r1", reason="function:timeout", count=2),
        "tracking_cursors": dict(run_id="r1", sink="tensorboard", iteration=1, eval_version=-1, ended=False),
        "evals": dict(
            run_id="r1",
            policy_version=1,
            launched_at=4.0,
            failures=0,
            retry_at=0.0,
            given_up=False,
        ),
        "pod_memory": dict(
            run_id="r1",
            pod="r1-rollout-0",
            role="rollout",
            at=3.0,
            bytes=1e9,
            peak_bytes=2e9,
        ),
    }
    for name, row in rows.items():
        if TABLE_REVISIONS[name] <= at:
            _insert(conn, name, **row)


def _assert_filled_at(url: str, at: int) -> None:
    """Every row ``_fill(at)`` wrote is there, and the columns added since read their defaults."""
    with closing(StateStore(url)) as s:
        run = s.get_run("r1")
        stopping = ("CANCELLING", "CANCELLED", "cancelled by the user") if at == 1 else ("RUNNING", None, None)
        assert (run.status, run.ending_status, run.ending_reason) == stopping
        assert (
            run.name,
            run.spec,
            run.created_at,
            run.started_at,
            run.samples_trained,
        ) == ("n", {"model": "tiny"}, 1.5, 2.5, 16)
        assert (
            run.tenant,
            run.prompt_count,
            run.reward_failures,
            run.last_reward_error,
            run.last_error,
        ) == ("default", 0, 0, None, None)
        assert (run.queues_deleted, run.samples_filtered, run.reward_url) == (
            False,
            0,
            None,
        )
        # The one time became the any-zone refusal.
        assert run.spot_training_refusals == ({"": 7.5} if at in (12, 13) else None)
        assert [(i.iteration, i.metrics) for i in s.run_view("r1", latest=5).latest] == [(1, {"actor/pg_loss": 0.2})]
        (entry,) = s.ledger("r1")
        assert (entry.pod, entry.started_at, entry.ended_at, entry.outcome) == (
            "r1-rollout-0",
            2.0,
            5.0,
            None,
        )
    engine = create_engine(url)
    with engine.connect() as conn:
        for name, revision in TABLE_REVISIONS.items():
            count = conn.execute(select(func.count()).select_from(table(name))).scalar()
            assert count == (1 if revision <= at else 0), name
    engine.dispose()


def _differences(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata)


@pytest.mark.parametrize("at", range(1, len(REVISIONS)))
def test_store_at_an_earlier_revision_upgrades_with_its_rows(store_url: str, engine: Engine, at: int) -> None:
    _upgrade(engine, REVISIONS[at - 1])
    with engine.begin() as conn:
        _fill(conn, at)
    _assert_filled_at(store_url, at)
    with engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == HEAD


def test_new_store_is_at_head_and_reopens(store_url: str, engine: Engine) -> None:
    StateStore(store_url).close()
    StateStore(store_url).close()  # a second open applies nothing
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [HEAD]


def test_head_schema_is_the_models(store_url: str, engine: Engine) -> None:
    """What keeps models and revisions honest: a column, table, index, type or nullability in one
    and not the other is a difference."""
    StateStore(store_url).close()
    assert _differences(engine) == []


def _as_hand_rolled(engine: Engine, version: int) -> None:
    """What the hand-rolled migrations left at ``version``: the schema, with ``schema_version``
    holding 1..version in place of Alembic's version table."""
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE alembic_version"))
        conn.execute(text("CREATE TABLE schema_version (version INTEGER NOT NULL)"))
        for v in range(1, version + 1):
            conn.execute(text("INSERT INTO schema_version (version) VALUES (:v)"), {"v": v})


@pytest.mark.parametrize("version", [1, 6, 11])
def test_store_of_the_hand_rolled_migrations_is_adopted(store_url: str, engine: Engine, version: int) -> None:
    _upgrade(engine, REVISIONS[version - 1])
    with engine.begin() as conn:
        _fill(conn, version)
    _as_hand_rolled(engine, version)
    _assert_filled_at(store_url, version)
    assert "schema_version" not in inspect(engine).get_table_names()
    assert _differences(engine) == []


@pytest.mark.parametrize("version", [7, 8, 11])
def test_store_that_numbered_tracking_cursors_7_gets_reward_failures(
    store_url: str, engine: Engine, version: int
) -> None:
    """Builds that numbered tracking_cursors 7 and evals 8 left stores without reward_failures at
    version 7 or 8, and later ones took them to 11 still without it."""
    if version == 11:
        _upgrade(engine, "0011")
        with engine.begin() as conn:
            _fill(conn, 6)
            conn.execute(text("DROP TABLE reward_failures"))
    else:
        _upgrade(engine, "0006")
        with engine.begin() as conn:  # what the hand-rolled tracking_cursors and evals migrations created
            _fill(conn, 6)
            TrackingCursorRow.__table__.create(conn)
            if version == 8:
                EvalRow.__table__.create(conn)
    _as_hand_rolled(engine, version)
    with closing(StateStore(store_url)) as s:
        s.count_reward_failures("r1", {"function:timeout": 1}, "timeout")
        assert s.run_view("r1", latest=1).reward_failures == {"function:timeout": 1}
        assert s.get_run("r1").status == RunStatus.RUNNING.value
    assert _differences(engine) == []
    with engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == HEAD


def test_store_of_a_newer_spotrl_is_refused_with_what_to_do(store_url: str, engine: Engine) -> None:
    StateStore(store_url).close()
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(RuntimeError, match="a newer spotrl has upgraded it; run that version"):
        StateStore(store_url)
