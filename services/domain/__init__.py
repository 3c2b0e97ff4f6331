"""A run's vocabulary and artefacts, shared by both planes: its spec, its names, its prompts,
the rotation of its policy versions and its sample backlog."""
