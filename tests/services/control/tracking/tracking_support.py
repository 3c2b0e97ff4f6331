"""Runs as the scheduler records them, for the tracking tests: iterations with a training job's
metrics (verl's names), a rollout worker on the ledger, and the run's end."""

from __future__ import annotations

from contracts.status import RunStatus
from services.ports.state.state_store import StateStore
from tests.iteration_rows import iteration_row

T0 = 1_790_000_000.0  # when the test runs started (unix seconds)


def job_metrics(i: int) -> dict[str, float | None]:
    """What a training job records for iteration ``i`` (trainer_core.rl.update, selection, memory)."""
    return {
        "actor/pg_loss": 0.5 / i,
        "actor/pg_clipfrac": 0.01 * i,
        "actor/ppo_kl": 0.001 * i,
        "actor/kl_ref": 0.002 * i,
        "actor/entropy": 1.5 - 0.1 * i,
        "actor/grad_norm": 0.3,
        "actor/loss": 0.4 / i,
        "critic/vf_loss": 0.2 / i,
        "critic/vf_clipfrac": 0.0,
        "response_length/mean": 40.0 + i,
        "response_length/clip_ratio": 0.125,
        "reward/mean": 0.1 * i,
        "perf/tokens_per_s": 900.0,
        "perf/peak_memory_bytes": 2.5e9,
        "data/staleness_mean": 0.5,
        "critic/explained_variance": None,  # NaN, stored as null
    }


def record(store: StateStore, run_id: str, i: int) -> None:
    """Iteration ``i`` as the scheduler records it, ending at T0 + 100 i."""
    metrics = job_metrics(i)
    store.record_iteration(
        iteration_row(
            run_id,
            i,
            mean_reward=0.1 * i,
            kl=0.002 * i,
            loss=0.4 / i,
            seconds=30.0 + i,
            samples_trained=64,
            samples_dropped=i % 2,
            metrics=metrics,
            ended_at=T0 + 100 * i,
        )
    )


def make_run(store: StateStore, run_id: str, *, tracking: dict | None = None, iterations: int = 0) -> str:
    """A RUNNING run with ``iterations`` iterations and a rollout worker billed from T0 (g6.xlarge spot, open)."""
    store.create_run(run_id, name=None, spec={} if tracking is None else {"tracking": tracking})
    store.set_status(run_id, RunStatus.RUNNING)
    store.open_ledger(
        run_id=run_id,
        role="rollout",
        pod=f"{run_id}-rollout-0",
        instance_type="g6.xlarge",
        capacity_type="spot",
        price_per_hour=0.35,
        price_source="test",
        started_at=T0,
    )
    for i in range(1, iterations + 1):
        record(store, run_id, i)
    return run_id


def end_run(store: StateStore, run_id: str, status: RunStatus = RunStatus.SUCCEEDED) -> None:
    store.begin_ending(run_id, status, "done")
    store.set_status(run_id, status, "done")
