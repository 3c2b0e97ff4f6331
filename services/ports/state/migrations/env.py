"""Alembic's environment for the state store: it runs on the connection the store hands it.

``services.ports.state.migrations.migrate`` opens the transaction (and takes the lock) first
and passes the connection in ``config.attributes``, so every revision, the adoption of a store
made by the hand-rolled migrations and the version row commit together or not at all.
"""

from alembic import context

from services.ports.state.state_schema import Base

context.configure(connection=context.config.attributes["connection"], target_metadata=Base.metadata)
# The connection is already in the store's transaction: this begins none of its own.
with context.begin_transaction():
    context.run_migrations()
