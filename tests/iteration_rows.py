"""An iteration's row as the state store records it, built with plain defaults for the tests that
only care about a few of its fields; and a past training job, its ledger entry with its
iteration, for the tests and benches that give runs a history."""

from __future__ import annotations

from typing import Any

from services.ports.state.state_schema import IterationRow
from services.ports.state.state_store import StateStore


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


def past_training_job(
    state: StateStore, run_id: str, n: int, started_at: float, seconds: float, *, price_source: str, **fields: Any
) -> None:
    """Training job ``n`` of ``run_id`` as the scheduler leaves it: a ledger entry (one on-demand
    p4d.24xlarge from ``started_at`` for ``seconds``, succeeded) and iteration ``n``, ended with
    it; ``fields`` set the iteration's other values."""
    pod, ended_at = f"{run_id}-train-{n}", started_at + seconds
    state.open_ledger(
        run_id=run_id,
        role="training",
        pod=pod,
        instance_type="p4d.24xlarge",
        capacity_type="on-demand",
        price_per_hour=21.96,
        price_source=price_source,
        started_at=started_at,
    )
    state.close_ledger(pod, ended_at=ended_at, outcome="succeeded")
    state.record_iteration(iteration_row(run_id, n, seconds=seconds, ended_at=ended_at, **fields))
