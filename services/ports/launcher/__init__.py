"""The pod launcher: the interface, local processes (embedded) and Kubernetes (production)."""
