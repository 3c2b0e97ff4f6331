"""Response schemas of the REST API (requests are ``services.domain.runspec.RunSpec``)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any, Self

from pydantic import BaseModel, Field
from sqlalchemy.engine import Row

from contracts.status import RunStatus
from services.control.cost.lower_bound import LOWER_BOUND_DEFINITION, LOWER_BOUND_MEANING
from services.domain.runspec import RunSpec
from services.ports.state.state_schema import RunRow
from services.ports.state.state_store import RunColumns

_RUN_COLUMNS = tuple(RunRow.__table__.columns.keys())


@cache
def _columns_shown(schema: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``schema`` that are columns of the runs table."""
    return tuple(name for name in schema.model_fields if name in _RUN_COLUMNS)


def columns_of(row: Any) -> Mapping[str, Any]:
    """A stored row's columns by name: a Core row's mapping (its attributes are found only after
    an AttributeError is raised and caught, which costs more than the lookup), or the column
    attributes of an ORM row."""
    if isinstance(row, Row):
        return row._mapping
    return {column.key: getattr(row, column.key) for column in row.__table__.columns}


class SampleCounts(BaseModel):
    produced: int = Field(description="Samples queued by rollout workers.")
    trained: int = Field(description="Samples used by a training iteration (each exactly once).")
    dropped: int = Field(
        description="Samples discarded: duplicates, beyond the staleness bound, or left when the run ended."
    )
    filtered: int = Field(
        description="Samples rollout workers generated and dropped before queueing: whole groups whose rewards were all "
        "equal (DAPO dynamic sampling, training.dynamic_sampling); not among produced."
    )


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


class EvalPublic(BaseModel):
    """A policy version's held-out evaluation (the spec's `eval`)."""

    policy_version: int = Field(description="The version evaluated; 0 is the base model.")
    mean_score: float = Field(description="Mean reward of every response to every held-out prompt.")
    metrics: dict[str, float] = Field(description="The spec's eval metrics by name: `mean`, `pass@k`.")
    prompts: int = Field(description="Held-out prompts evaluated.")
    seconds: float = Field(description="Wall time of the eval pod's work.")
    ended_at: float


class RunSummaryPublic(BaseModel):
    """A run as listed: where it stands, without its spec and iterations (GET the run for those)."""

    id: str
    tenant: str = Field(description="The tenant whose token submitted the run.")
    name: str | None
    status: RunStatus = Field(description=" ".join(f"{s.value}: {s.meaning}" for s in RunStatus))
    status_reason: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    policy_version: int
    iterations_done: int
    last_mean_reward: float | None = Field(description="Mean reward of the latest iteration.")
    samples: SampleCounts
    spent_dollars: float

    @classmethod
    def of(cls, row: RunColumns, spent: float, **shown: Any) -> Self:
        """The run stored as `row`, having spent `spent`, as this schema shows it: each field named
        as a column of the row is that column (so the list, the run and every answer that shows a
        run map the row alike, and a column added to a schema is shown without another line);
        `shown` gives the fields the row does not hold, or shows otherwise."""
        columns = columns_of(row)
        same = {name: columns[name] for name in _columns_shown(cls) if name not in shown}
        samples = SampleCounts(
            produced=columns["samples_produced"],
            trained=columns["samples_trained"],
            dropped=columns["samples_dropped"],
            filtered=columns["samples_filtered"],
        )
        return cls(**same, samples=samples, spent_dollars=spent, **shown)


class RunPublic(RunSummaryPublic):
    iterations: list[IterationPublic] = Field(
        description="The latest iterations, oldest first: at most `iterations_limit` of GET /v1/runs/{run_id} (100 unless asked, and in every other answer)."
    )
    iterations_total: int = Field(description="Iterations the run has recorded, those not shown included.")
    prompt_count: int = Field(description="Prompts in the run's prompt set.")
    spec: RunSpec = Field(
        description="The run spec as submitted (defaults filled in); inline prompts read `inline` (see prompt_count)."
    )
    last_error: str | None = Field(
        default=None,
        description="The scheduler's latest temporary or unexpected error on this run, while it retries; null once it reconciles "
        "cleanly, unless an eval was given up (its pods failing): then why.",
    )
    reward_failures: int = Field(
        default=0, description="Reward computations that failed or timed out (each such response scored 0)."
    )
    reward_failures_by_reason: dict[str, int] = Field(
        default_factory=dict,
        description="reward_failures by `<fn>:<kind>`, kind one of exception, timeout, crash, memory, invalid, unavailable.",
    )
    last_reward_error: str | None = Field(default=None, description="Why the latest failed reward computation failed.")
    report_url: str = Field(
        description="The run's report page (HTML: reward, cost and pod timelines), relative to the API's root."
    )
    evals: list[EvalPublic] = Field(
        default_factory=list,
        description="Held-out evals recorded, by policy version: the latest `iterations_limit` of them.",
    )


class RunsPublic(BaseModel):
    runs: list[RunSummaryPublic]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class DatasetPublic(BaseModel):
    id: str
    uri: str = Field(description="What a run spec's `prompts` names to use this prompt set.")
    prompts: int = Field(description="Prompts in the set.")
    bytes: int = Field(description="Size of the upload.")


class FieldErrorPublic(BaseModel):
    loc: list[str | int] = Field(description="Where: `body` and the field's path.")
    msg: str = Field(description="The rule it breaks (never the value sent).")
    type: str


class ValidationErrorPublic(BaseModel):
    """A 422: what the request breaks, field by field."""

    detail: list[FieldErrorPublic]


class ErrorPublic(BaseModel):
    """Every error but a validation error (422): what went wrong and what to do."""

    detail: str


class LedgerEntryPublic(BaseModel):
    role: str
    pod: str
    instance_type: str
    capacity_type: str
    price_per_hour: float
    price_source: str
    started_at: float
    ended_at: float | None
    # How the pod ended: succeeded, failed or killed (a spot preemption among them); None while it runs.
    outcome: str | None = None
    seconds: float
    dollars: float = Field(
        description="Billed by the provider's rule (per second with a 60 s minimum on AWS), in the report's currency."
    )


class CostPublic(BaseModel):
    run_id: str
    currency: str = Field(
        description="Of every figure below (the *_dollars are amounts in it): the run's instance types' one currency."
    )
    total_dollars: float
    by_role: dict[str, float]
    by_capacity_type: dict[str, float]
    wall_seconds: float
    always_on_dollars: float = Field(
        description="The training instance on-demand for the whole wall time, plus the rollout work at on-demand prices."
    )
    lower_bound_dollars: float = Field(description=LOWER_BOUND_MEANING)
    lower_bound_definition: str = Field(
        description=f"What `lower_bound_dollars` counts, in one line to print beside it: `{LOWER_BOUND_DEFINITION}`."
    )
    savings_ratio: float | None = Field(description="always_on / total: how many times cheaper than always-on.")
    efficiency: float | None = Field(description="lower_bound / total.")
    entries: list[LedgerEntryPublic] = Field(
        description="One page of the run's ledger, oldest first (at most `limit` entries); every figure above is over the whole ledger."
    )
    entries_total: int = Field(description="Entries in the run's ledger, on every page.")
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page of entries; null on the last page.")


class PodPublic(BaseModel):
    name: str = Field(
        description="The pod's deterministic name: `<run>-rollout-<slot>`, `<run>-train-<iteration>`, `<run>-warm-<iteration>`, `<run>-eval-<version>` or `<run>-reward`."
    )
    role: str = Field(description="`rollout`, `training`, `standby`, `eval` or `reward`.")
    running: bool = Field(
        description="Still known to the launcher (running, or ended and not yet reaped); false: ended, its log kept in the object store."
    )
    waiting_for_node: bool = Field(
        description="No node has taken it yet (on Kubernetes: no capacity of its kind, or its node still starting); no machine is billed for it meanwhile."
    )


class PodsPublic(BaseModel):
    run_id: str
    pods: list[PodPublic] = Field(description="The run's pods with a log, sorted by name (at most 1000).")
    truncated: bool = Field(description="More pods than this list holds.")


class PodLogPublic(BaseModel):
    run_id: str
    pod: str
    running: bool = Field(
        description="Read from the launcher (the pod has not been reaped); false: the log kept when the pod ended."
    )
    lines: list[str] = Field(
        description="The log's last lines, oldest first, without line ends (at most `tail`, and at most 1 MiB in all)."
    )
    truncated: bool = Field(description="Lines were left out at the start to keep to the byte bound.")
