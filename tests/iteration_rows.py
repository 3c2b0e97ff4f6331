"""An iteration's row as the state store records it, built with plain defaults for the tests that
only care about a few of its fields."""

from __future__ import annotations

from typing import Any

from services.ports.state.state_schema import IterationRow


def iteration_row(run_id: str, n: int, **fields: Any) -> IterationRow:
    """Iteration ``n`` of ``run_id`` (policy version ``n``, ended at ``n`` seconds), one that trained
    8 samples and dropped none; ``fields`` set any of the row's other values."""
    row: dict[str, Any] = dict(
        policy_version=n,
        mean_reward=0.5,
        kl=0.0,
        loss=0.0,
        seconds=1.0,
        samples_trained=8,
        samples_dropped=0,
        metrics={},
        ended_at=float(n),
    )
    return IterationRow(run_id=run_id, iteration=n, **(row | fields))
