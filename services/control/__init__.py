"""The control plane: the API, the scheduler, cost accounting, the simulator and experiment tracking.

It imports no torch and no trainer_core (an import contract in pyproject.toml keeps it so)."""
