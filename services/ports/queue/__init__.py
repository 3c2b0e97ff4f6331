"""The sample and prompt queue: the interface, SQLite (embedded) and Kafka (production)."""
