"""The object store: the interface, local files (embedded) and S3 (production)."""
