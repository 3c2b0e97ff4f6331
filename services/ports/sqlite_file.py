"""A SQLite file shared by the processes of one machine, used from any thread of each process.

Each process opens its own connection (a connection must never cross a ``fork``); inside a
process one connection is shared by all threads behind a lock, because sqlite3 connections
are not safe to use from two threads at once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

# Writers queue on the file lock; a long busy timeout turns contention into waiting, not errors.
BUSY_TIMEOUT_S = 30.0


class SqliteFile:
    """One connection to ``path`` in WAL mode; ``schema`` (idempotent DDL) is applied on open."""

    def __init__(self, path: Path, *, schema: str, synchronous: Literal["NORMAL", "FULL"]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE for writes) rather than
        # sqlite3's implicit deferred ones, which can fail with SQLITE_BUSY on upgrade to a write.
        # check_same_thread=False: the lock below serialises use across threads.
        self._conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            self._conn.close()
            raise RuntimeError(
                f"SQLite could not put {path} in WAL mode (got {mode!r}); WAL needs a local file system: "
                "move the file off network or read-only storage"
            )
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        with self.write() as conn:
            for statement in filter(str.strip, schema.split(";")):
                conn.execute(statement)

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A consistent snapshot for several SELECTs; never blocks writers (WAL)."""
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                yield self._conn
            finally:
                self._conn.execute("COMMIT")

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction, committed when the block ends and rolled back if it raises.

        BEGIN IMMEDIATE takes the write lock up front, so two writers queue instead of one
        failing when both try to upgrade a read transaction.
        """
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
