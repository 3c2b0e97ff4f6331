"""The state store's SQLAlchemy engine: SQLite's pragmas and transactions, PostgreSQL's
isolation level, strict JSON (``services.ports.state.state_store`` says why each is so).
"""

from __future__ import annotations

import json
import math
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection


def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    # isolation_level=None: pysqlite issues no BEGIN of its own (it would only before the first
    # write, leaving the reads before it outside the transaction); _sqlite_begin issues them.
    dbapi_conn.isolation_level = None
    # WAL lets the API read while a pod writes; the busy timeout rides out short write locks.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


WRITE_OPTION = "spotrl_write"  # execution option of the connections of writing sessions


def _sqlite_begin(conn: Connection) -> None:
    # A writer takes the write lock up front: writers queue on the busy timeout, and none reads a
    # row that another changes before it writes. A reader gets one snapshot, never blocking (WAL).
    # A writer's BEGIN goes through SQLAlchemy, whose events see what takes the file's lock; a
    # reader's takes no lock and goes to the driver: through SQLAlchemy it would cost as much as
    # the one statement most of the API's reads are.
    if conn.get_execution_options().get(WRITE_OPTION):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.connection.driver_connection.execute("BEGIN")  # type: ignore[union-attr]


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None: JSON has no such numbers (PostgreSQL refuses them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_dumps(value: Any) -> str:
    return json.dumps(_finite(value), allow_nan=False)


def create_state_engine(url: URL) -> Any:
    if url.get_backend_name() not in ("sqlite", "postgresql"):
        raise ValueError(
            f"the state store runs on SQLite or PostgreSQL (postgresql+psycopg://...), not {url.get_backend_name()}"
        )
    if url.get_backend_name() == "sqlite":
        engine = create_engine(url, json_serializer=_json_dumps)
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    # READ COMMITTED whatever the server's default: after waiting for a row lock, the next
    # statement sees what the lock's holder committed (under REPEATABLE READ or SERIALIZABLE it
    # would fail with a serialization error instead). pool_pre_ping: a connection the server
    # closed (restart, failover, idle timeout) is replaced rather than failing a request.
    return create_engine(url, json_serializer=_json_dumps, isolation_level="READ COMMITTED", pool_pre_ping=True)


def dialect_insert(dialect: str) -> Any:
    """The INSERT with ON CONFLICT of ``dialect`` (imported here: the engine of the other is never loaded)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert
