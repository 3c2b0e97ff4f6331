"""Adopting a store that spotrl's earlier hand-rolled migrations made: they kept the number of
the last migration applied in a table ``schema_version``, and migration N did what revision N
does (``versions/``), so such a store is stamped at that revision and the table goes.

One exception, from the order those migrations once had: before ``reward_failures`` became
migration 7, builds numbered ``tracking_cursors`` 7 and ``evals`` 8, and a store that passed
through them has a version of 7 or more but no ``reward_failures`` table (the later builds
skipped it). Such a store gets revision 0007's table, then the revision its tables match.
"""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

LEGACY_TABLE = "schema_version"


def _revision(version: int) -> str:
    return f"{version:04d}"


def adopt_hand_rolled(conn: Connection, config: Config) -> None:
    """Stamp a store that has ``schema_version`` and no Alembic version at its revision, and drop
    ``schema_version``; any other store is left alone."""
    tables = set(inspect(conn).get_table_names())
    if LEGACY_TABLE not in tables or "alembic_version" in tables:
        return
    version = conn.execute(text(f"SELECT MAX(version) FROM {LEGACY_TABLE}")).scalar() or 0
    if version >= 7 and "reward_failures" not in tables:
        command.stamp(config, _revision(6))
        command.upgrade(config, _revision(7))
        version = max(version, 9 if "evals" in tables else 8)
    if version:
        command.stamp(config, _revision(version))
    conn.execute(text(f"DROP TABLE {LEGACY_TABLE}"))
