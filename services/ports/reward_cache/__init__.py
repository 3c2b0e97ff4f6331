"""The shared reward cache: the interface, SQLite (embedded) and Redis (production)."""
