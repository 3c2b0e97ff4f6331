"""The state store: runs, iterations, pods' ledger, evals; SQLAlchemy on SQLite or PostgreSQL."""
