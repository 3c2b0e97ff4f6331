"""Response schemas of the REST API (requests are ``services.runspec.RunSpec``)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from contracts.status import RunStatus
from services.runspec import RunSpec


class SampleCounts(BaseModel):
    produced: int = Field(description="Samples queued by rollout workers.")
    trained: int = Field(description="Samples used by a training iteration (each exactly once).")
    dropped: int = Field(description="Samples discarded: duplicates, beyond the staleness bound, or left when the run ended.")


class IterationPublic(BaseModel):
    iteration: int
    policy_version: int
    mean_reward: float
    kl: float
    loss: float
    seconds: float
    samples_trained: int
    samples_dropped: int
    metrics: dict[str, float]


class RunPublic(BaseModel):
    id: str
    name: str | None
    status: RunStatus = Field(description=" ".join(f"{s.value}: {s.meaning}" for s in RunStatus))
    status_reason: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    policy_version: int
    samples: SampleCounts
    iterations: list[IterationPublic]
    spent_dollars: float
    spec: RunSpec = Field(description="The run spec as submitted (defaults filled in).")
    last_error: str | None = Field(
        default=None,
        description="The scheduler's latest temporary or unexpected error on this run, while it retries; null once it reconciles cleanly.",
    )


class RunsPublic(BaseModel):
    runs: list[RunPublic]


class LedgerEntryPublic(BaseModel):
    role: str
    pod: str
    instance_type: str
    capacity_type: str
    price_per_hour: float
    price_source: str
    started_at: float
    ended_at: float | None
    seconds: float
    dollars: float


class CostPublic(BaseModel):
    run_id: str
    currency: str
    total_dollars: float
    by_role: dict[str, float]
    by_capacity_type: dict[str, float]
    wall_seconds: float
    always_on_dollars: float = Field(description="The training instance on-demand for the whole wall time, plus the rollout work at on-demand prices.")
    lower_bound_dollars: float = Field(description="Every pod's seconds at the cheapest price of its instance type.")
    savings_ratio: float | None = Field(description="always_on / total: how many times cheaper than always-on.")
    efficiency: float | None = Field(description="lower_bound / total.")
    entries: list[LedgerEntryPublic]
