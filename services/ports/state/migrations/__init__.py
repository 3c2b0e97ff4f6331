"""The state store's schema migrations: Alembic revisions in ``versions/``, run by the store itself.

``migrate`` brings a store's schema to the head revision when the store opens; nobody runs an
``alembic`` command or needs an ``alembic.ini``. Revision 0001 is the initial schema as the first
release created it, frozen; each later revision changes what the one before it left, so a new
revision is written against the head revision's schema, and the models in
``services.ports.state.state_schema`` must end up equal to it (tests/services/ports/
test_state_migrations.py compares them). A store made by spotrl's earlier hand-rolled migrations
is adopted first (``services.ports.state.migrations.adopt``).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from services.ports.state.migrations.adopt import adopt_hand_rolled

# Held while migrating a PostgreSQL database (a transaction-level advisory lock): the key is
# arbitrary, fixed, and spotrl's own ("spotrl" in ASCII).
MIGRATION_LOCK_KEY = 0x73706F74726C

SCRIPT_LOCATION = str(Path(__file__).parent)


def alembic_config(conn: Connection) -> Config:
    """Alembic's configuration for running on ``conn`` (``env.py`` takes it from there)."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    config.attributes["connection"] = conn
    return config


def migrate(engine: Engine) -> None:
    """Bring the schema to the head revision. Safe to run from several processes at once.

    One transaction, which processes opening the store at once take in turn: on PostgreSQL it
    first takes an advisory lock (two processes creating one table at once would otherwise both
    try, and one would fail), on SQLite ``engine`` is the store's writing engine, whose
    transactions begin with the file's write lock (``services.ports.state.state_engine``). DDL is
    transactional on both: a revision that fails leaves the schema where it was.
    """
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        config = alembic_config(conn)
        adopt_hand_rolled(conn, config)
        try:
            command.upgrade(config, "head")
        except CommandError as e:
            raise RuntimeError(
                f"the state store's schema is at a revision this spotrl does not know ({e}): a newer spotrl "
                "has upgraded it; run that version (or a later one) against this store"
            ) from e
