"""The state store's tables and their numbered migrations (SQLAlchemy, for SQLite and PostgreSQL).

A store opened on an older file or database brings it up to date before use (``migrate``);
migrations are append-only, one schema version each, and each runs on SQLite and PostgreSQL alike.

Types as each adapter stores them: ``Float`` is a double on both (PostgreSQL ``double precision``:
wall-clock seconds keep their microseconds); ``JSON`` is text on SQLite and ``json`` on
PostgreSQL, which has no NaN or infinities, so the store writes those as null on both;
``String(n)`` is a limit that only PostgreSQL enforces, so the store clips the free-text messages
it keeps to their width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Integer, String, inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


# The tenant of runs submitted without tenants configured (one machine, no tokens), and of runs
# stored before tenants existed.
DEFAULT_TENANT = "default"


class Base(DeclarativeBase):
    pass


class RunRow(Base):
    __tablename__ = "runs"

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
    # How the pod ended (``services.backends.launcher.pod_outcome``: succeeded, failed, killed),
    # set when its entry is closed; None while it runs, and for entries closed before version 5.
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
    (``services.tracking``); ``ended``: the run's end is sent too, nothing more will be."""

    __tablename__ = "tracking_cursors"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    sink: Mapped[str] = mapped_column(String(32), primary_key=True)
    iteration: Mapped[int] = mapped_column(Integer, default=0)
    eval_version: Mapped[int] = mapped_column(Integer, default=-1)
    ended: Mapped[bool] = mapped_column(Boolean, default=False)


# --- migrations ---------------------------------------------------------------------------
# Append only: each entry upgrades the schema by one version. Version 1 is the initial schema.
def _m001_initial(conn: Connection) -> None:
    Base.metadata.create_all(conn)


def _m002_leases_and_stopping_statuses(conn: Connection) -> None:
    """The scheduler's leader lease, ``runs.last_error``, and CANCELLING/ENDING as statuses.

    Runs that were stopping under version 1 (status RUNNING beside ``cancel_requested`` or
    ``ending_status``) get the stopping status, and the flag goes. A file created fresh already
    has the current tables from version 1 (it creates the models' tables), hence the checks.
    """
    LeaseRow.__table__.create(conn, checkfirst=True)
    columns = {c["name"] for c in inspect(conn).get_columns("runs")}
    if "last_error" not in columns:
        conn.execute(text("ALTER TABLE runs ADD COLUMN last_error VARCHAR(500)"))
    if "cancel_requested" in columns:
        conn.execute(
            text(
                "UPDATE runs SET"
                " status = CASE WHEN COALESCE(ending_status, 'CANCELLED') = 'CANCELLED' THEN 'CANCELLING' ELSE 'ENDING' END,"
                " ending_status = COALESCE(ending_status, 'CANCELLED'),"
                " ending_reason = COALESCE(ending_reason, 'cancelled by the user'),"
                " status_reason = COALESCE(ending_reason, 'cancelled by the user')"
                " WHERE status IN ('PENDING', 'RUNNING') AND (ending_status IS NOT NULL OR cancel_requested)"
            )
        )
        conn.execute(text("ALTER TABLE runs DROP COLUMN cancel_requested"))


def _m003_tenants_prompt_counts_reward_failures(conn: Connection) -> None:
    """``runs.tenant`` (existing runs belong to the default tenant), ``runs.prompt_count``,
    ``runs.reward_failures`` and ``runs.last_reward_error``. A file created fresh already has
    them (version 1 creates the models' tables)."""
    columns = {c["name"] for c in inspect(conn).get_columns("runs")}
    if "tenant" not in columns:
        conn.execute(text(f"ALTER TABLE runs ADD COLUMN tenant VARCHAR(64) NOT NULL DEFAULT '{DEFAULT_TENANT}'"))
        conn.execute(text("CREATE INDEX ix_runs_tenant ON runs (tenant)"))
    if "prompt_count" not in columns:
        conn.execute(text("ALTER TABLE runs ADD COLUMN prompt_count INTEGER NOT NULL DEFAULT 0"))
    if "reward_failures" not in columns:
        conn.execute(text("ALTER TABLE runs ADD COLUMN reward_failures INTEGER NOT NULL DEFAULT 0"))
    if "last_reward_error" not in columns:
        conn.execute(text("ALTER TABLE runs ADD COLUMN last_reward_error VARCHAR(500)"))


def _m004_queues_deleted(conn: Connection) -> None:
    """``runs.queues_deleted``: runs ended before it keep their topics until the retention sweep."""
    if "queues_deleted" not in {c["name"] for c in inspect(conn).get_columns("runs")}:
        conn.execute(text("ALTER TABLE runs ADD COLUMN queues_deleted BOOLEAN NOT NULL DEFAULT FALSE"))


def _m005_worker_stats_and_pod_outcomes(conn: Connection) -> None:
    """``worker_stats`` (rollout workers' counters, exported by the API's /metrics) and
    ``ledger.outcome``; entries closed before it keep no outcome."""
    WorkerStatsRow.__table__.create(conn, checkfirst=True)
    if "outcome" not in {c["name"] for c in inspect(conn).get_columns("ledger")}:
        conn.execute(text("ALTER TABLE ledger ADD COLUMN outcome VARCHAR(16)"))


def _m006_samples_filtered(conn: Connection) -> None:
    """``runs.samples_filtered``: dynamic sampling's drops, counted apart from the queued samples'.
    Runs before it counted them in ``samples_dropped`` until they ended (then lost them): 0."""
    if "samples_filtered" not in {c["name"] for c in inspect(conn).get_columns("runs")}:
        conn.execute(text("ALTER TABLE runs ADD COLUMN samples_filtered INTEGER NOT NULL DEFAULT 0"))


def _m007_reward_failures_by_reason(conn: Connection) -> None:
    """The ``reward_failures`` table: a run's failed reward computations by reason. Runs before it
    keep their total in ``runs.reward_failures`` only."""
    RewardFailureRow.__table__.create(conn, checkfirst=True)


def _m008_tracking_cursors(conn: Connection) -> None:
    """The ``tracking_cursors`` table: what each experiment tracker has of each run."""
    TrackingCursorRow.__table__.create(conn, checkfirst=True)


def _m009_evals(conn: Connection) -> None:
    """The ``evals`` table: held-out evaluations of runs' policy versions."""
    EvalRow.__table__.create(conn, checkfirst=True)


def _m010_pod_memory(conn: Connection) -> None:
    """The ``pod_memory`` table: each pod's memory over time."""
    PodMemoryRow.__table__.create(conn, checkfirst=True)


def _m011_reward_url(conn: Connection) -> None:
    """``runs.reward_url``: where a run's reward server listens. A file created fresh already has it."""
    if "reward_url" not in {c["name"] for c in inspect(conn).get_columns("runs")}:
        conn.execute(text("ALTER TABLE runs ADD COLUMN reward_url VARCHAR(256)"))


MIGRATIONS: Sequence[Callable[[Connection], None]] = (
    _m001_initial,
    _m002_leases_and_stopping_statuses,
    _m003_tenants_prompt_counts_reward_failures,
    _m004_queues_deleted,
    _m005_worker_stats_and_pod_outcomes,
    _m006_samples_filtered,
    _m007_reward_failures_by_reason,
    _m008_tracking_cursors,
    _m009_evals,
    _m010_pod_memory,
    _m011_reward_url,
)


# Held while migrating a PostgreSQL database (a transaction-level advisory lock): the key is
# arbitrary, fixed, and spotrl's own ("spotrl" in ASCII).
MIGRATION_LOCK_KEY = 0x73706F74726C


def migrate(engine: Engine) -> int:
    """Bring the schema to the latest version; returns it. Safe to run from several processes.

    One transaction, which processes opening the store at once take in turn: on PostgreSQL it
    first takes an advisory lock (two concurrent CREATE TABLE IF NOT EXISTS of one table can
    both try to create it, and one then fails), on SQLite the engine begins writing transactions
    with the file's write lock (``StateStore``). DDL is transactional on both: a migration that
    fails leaves the schema at the version before it.
    """
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        conn.execute(text("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"))
        current = conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar() or 0
        for version, step in enumerate(MIGRATIONS[current:], start=current + 1):
            step(conn)
            conn.execute(text("INSERT INTO schema_version (version) VALUES (:v)"), {"v": version})
    return len(MIGRATIONS)
