"""The state store's tables (SQLAlchemy models, for SQLite and PostgreSQL).

The schema in the databases is made by the Alembic revisions in
``services.ports.state.migrations``: a change here needs a new revision doing it, and a test
holds the head revision's schema equal to these models. A column's default is declared here once
(``default=``); the store's inserts leave such columns to it.

Types as each adapter stores them: ``Float`` is a double on both (PostgreSQL ``double precision``:
wall-clock seconds keep their microseconds); ``JSON`` is text on SQLite and ``json`` on
PostgreSQL, which has no NaN or infinities, so the store writes those as null on both;
``String(n)`` is a limit that only PostgreSQL enforces, so the store clips the free-text messages
it keeps to their width.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The tenant of runs submitted without tenants configured (one machine, no tokens), and of runs
# stored before tenants existed.
DEFAULT_TENANT = "default"


class Base(DeclarativeBase):
    pass


class RunRow(Base):
    __tablename__ = "runs"
    # The list's order (oldest first, then by id), of all runs and of a tenant's: a page seeks.
    __table_args__ = (
        Index("ix_runs_created_at_id", "created_at", "id"),
        Index("ix_runs_tenant_created_at_id", "tenant", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    # The tenant whose token submitted the run: only that tenant (and an admin) sees it.
    tenant: Mapped[str] = mapped_column(String(64), index=True, default=DEFAULT_TENANT)
    name: Mapped[str | None] = mapped_column(String(64))
    # Prompts in the run's prompt set (kept in the object store; the spec shows only where they came from).
    prompt_count: Mapped[int] = mapped_column(Integer, default=0)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    status_reason: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    # The latest published policy version; 0 is the base model named in the spec.
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    iterations_done: Mapped[int] = mapped_column(Integer, default=0)
    prompts_published: Mapped[int] = mapped_column(Integer, default=0)
    samples_produced: Mapped[int] = mapped_column(Integer, default=0)
    samples_trained: Mapped[int] = mapped_column(Integer, default=0)
    samples_dropped: Mapped[int] = mapped_column(Integer, default=0)
    # Samples rollout workers generated and dropped before queueing (DAPO dynamic sampling: groups
    # whose rewards were all equal); not among samples_produced, so not among samples_dropped.
    samples_filtered: Mapped[int] = mapped_column(Integer, default=0)
    last_mean_reward: Mapped[float | None] = mapped_column(Float)
    # While CANCELLING or ENDING: the terminal status the run will get once its pods are gone.
    ending_status: Mapped[str | None] = mapped_column(String(16))
    ending_reason: Mapped[str | None] = mapped_column(String(500))
    train_failures: Mapped[int] = mapped_column(Integer, default=0)
    next_train_at: Mapped[float] = mapped_column(Float, default=0.0)
    worker_slots_used: Mapped[int] = mapped_column(Integer, default=0)
    # Trainer-group committed offsets (summed) when the running training job was launched:
    # until they move, that job still holds one batch of the sample backlog.
    train_launch_committed: Mapped[int] = mapped_column(Integer, default=0)
    # The scheduler's latest temporary or unexpected error on this run; cleared once it reconciles.
    last_error: Mapped[str | None] = mapped_column(String(500))
    # Reward computations that failed or timed out (each such response scored 0), and the latest reason.
    reward_failures: Mapped[int] = mapped_column(Integer, default=0)
    last_reward_error: Mapped[str | None] = mapped_column(String(500))
    # The run's queue topics are deleted (some retention after it ended): nothing more to read there.
    queues_deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    # Where the run's reward server (the spec's reward_server) listens now, as it last said; None before it does.
    reward_url: Mapped[str | None] = mapped_column(String(256))
    # The spot zones where the run last gave up waiting for a training node, each with when: none
    # is tried again for a while from then (services.control.scheduler.spot_training; "": any zone).
    spot_training_refusals: Mapped[dict[str, float] | None] = mapped_column(JSON)


class IterationRow(Base):
    __tablename__ = "iterations"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    iteration: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy_version: Mapped[int] = mapped_column(Integer)
    mean_reward: Mapped[float] = mapped_column(Float)
    kl: Mapped[float] = mapped_column(Float)
    loss: Mapped[float] = mapped_column(Float)
    seconds: Mapped[float] = mapped_column(Float)
    samples_trained: Mapped[int] = mapped_column(Integer)
    samples_dropped: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    ended_at: Mapped[float] = mapped_column(Float)


class LedgerRow(Base):
    __tablename__ = "ledger"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    pod: Mapped[str] = mapped_column(String(128), index=True)
    instance_type: Mapped[str] = mapped_column(String(64))
    capacity_type: Mapped[str] = mapped_column(String(16))
    price_per_hour: Mapped[float] = mapped_column(Float)
    price_source: Mapped[str] = mapped_column(String(300))
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    # How the pod ended (``services.ports.launcher.launcher.pod_outcome``: succeeded, failed, killed),
    # set when its entry is closed; None while it runs, and for entries closed before revision 0005.
    outcome: Mapped[str | None] = mapped_column(String(16))


class WorkerStatsRow(Base):
    """What one rollout worker (a pod; ``worker`` is its pod name) has done, summed over its
    reports: counters that only grow, so a restarted worker of the same name adds to them."""

    __tablename__ = "worker_stats"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    worker: Mapped[str] = mapped_column(String(128), primary_key=True)
    samples_produced: Mapped[int] = mapped_column(Integer, default=0)
    generation_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    # Reward cache keys by result, as the worker's cache adapter counted them (RequestCounts).
    reward_cache_hits: Mapped[int] = mapped_column(Integer, default=0)
    reward_cache_misses: Mapped[int] = mapped_column(Integer, default=0)
    reward_cache_errors: Mapped[int] = mapped_column(Integer, default=0)
    # Not a counter: the most sequences its engine generated at once in its latest batch, as sized
    # from the memory free (services.data.rollout.generation_batch).
    generation_batch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reported_at: Mapped[float] = mapped_column(Float)


class RewardFailureRow(Base):
    """A run's failed reward computations of one reason, ``<fn>:<kind>`` (e.g. ``function:timeout``):
    a counter that only grows."""

    __tablename__ = "reward_failures"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    reason: Mapped[str] = mapped_column(String(64), primary_key=True)
    count: Mapped[int] = mapped_column(Integer, default=0)


class EvalRow(Base):
    """The held-out evaluation of one policy version of a run: opened when its eval pod is first
    launched, then either recorded (``metrics`` set from the pod's result) or failed, retried and
    perhaps given up (``given_up``, with ``error``)."""

    __tablename__ = "evals"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    policy_version: Mapped[int] = mapped_column(Integer, primary_key=True)
    launched_at: Mapped[float] = mapped_column(Float)
    # Failed eval pods of this version so far, and when the next may be launched.
    failures: Mapped[int] = mapped_column(Integer, default=0)
    retry_at: Mapped[float] = mapped_column(Float, default=0.0)
    given_up: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(String(500))
    # Set once recorded, from the eval pod's result (``contracts.evaluation.EvalResult``).
    mean_score: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prompts: Mapped[int | None] = mapped_column(Integer)
    samples: Mapped[int | None] = mapped_column(Integer)
    seconds: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)


class PodMemoryRow(Base):
    """A pod's memory at one moment (GPU memory where it has a GPU, else its RSS), reported by the
    pod every 30 s while it runs: the run's memory over time, for its experiment trackers."""

    __tablename__ = "pod_memory"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    pod: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    at: Mapped[float] = mapped_column(Float)
    bytes: Mapped[float] = mapped_column(Float)
    peak_bytes: Mapped[float] = mapped_column(Float)


class LeaseRow(Base):
    """A named lease: ``holder`` leads until ``expires_at`` (wall-clock seconds) unless it renews."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[float] = mapped_column(Float)


class TrackingCursorRow(Base):
    """How far one experiment tracker (``sink``: tensorboard, mlflow, wandb) has a run's figures:
    iterations up to ``iteration`` and evaluations up to policy version ``eval_version`` are sent
    (``services.control.tracking``); ``ended``: the run's end is sent too, nothing more will be."""

    __tablename__ = "tracking_cursors"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    sink: Mapped[str] = mapped_column(String(32), primary_key=True)
    iteration: Mapped[int] = mapped_column(Integer, default=0)
    eval_version: Mapped[int] = mapped_column(Integer, default=-1)
    ended: Mapped[bool] = mapped_column(Boolean, default=False)
