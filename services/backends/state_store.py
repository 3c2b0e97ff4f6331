"""The state store: runs, iterations and the cost ledger, through SQLAlchemy.

One code path for both adapters: SQLite (embedded default, a file shared by the API,
scheduler and pods on one machine) and PostgreSQL (production), chosen by the URL.
The schema is created and upgraded by the numbered migrations at the bottom; a store
opened on an older file brings it up to date before use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Integer,
    String,
    create_engine,
    event,
    func,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


class RunStatus(StrEnum):
    """Persisted run status. Allowed transitions are in ``_TRANSITIONS``."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


_TRANSITIONS: dict[RunStatus, set[RunStatus]] = {
    RunStatus.PENDING: {RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.FAILED},
    RunStatus.RUNNING: {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED},
    RunStatus.SUCCEEDED: set(),
    RunStatus.FAILED: set(),
    RunStatus.CANCELLED: set(),
}


class IllegalTransitionError(Exception):
    """A status change the run's current status does not allow (the API answers 409)."""


class RunNotFoundError(KeyError):
    """No run with that id (the API answers 404)."""


class Base(DeclarativeBase):
    pass


class RunRow(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(64))
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
    last_mean_reward: Mapped[float | None] = mapped_column(Float)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Set when the run has met an end condition but its pods are still stopping.
    ending_status: Mapped[str | None] = mapped_column(String(16))
    ending_reason: Mapped[str | None] = mapped_column(String(500))
    train_failures: Mapped[int] = mapped_column(Integer, default=0)
    next_train_at: Mapped[float] = mapped_column(Float, default=0.0)
    worker_slots_used: Mapped[int] = mapped_column(Integer, default=0)
    # Trainer-group committed offsets (summed) when the running training job was launched:
    # until they move, that job still holds one batch of the sample backlog.
    train_launch_committed: Mapped[int] = mapped_column(Integer, default=0)


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


@dataclass(frozen=True)
class LedgerEntry:
    """Who ran on what, for how long, at what price. Open entries are billed up to ``now``."""

    id: int
    run_id: str
    role: str
    pod: str
    instance_type: str
    capacity_type: str
    price_per_hour: float
    price_source: str
    started_at: float
    ended_at: float | None

    def seconds(self, now: float) -> float:
        return max(0.0, (self.ended_at if self.ended_at is not None else now) - self.started_at)

    def dollars(self, now: float) -> float:
        return self.seconds(now) * self.price_per_hour / 3600.0


# --- migrations ---------------------------------------------------------------------------
# Append only: each entry upgrades the schema by one version. Version 1 is the initial schema.
def _m001_initial(conn: Connection) -> None:
    Base.metadata.create_all(conn)


MIGRATIONS: Sequence[Callable[[Connection], None]] = (_m001_initial,)


def migrate(engine: Engine) -> int:
    """Bring the schema to the latest version; returns it. Safe to run from several processes."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"))
        current = conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar() or 0
        for version, step in enumerate(MIGRATIONS[current:], start=current + 1):
            step(conn)
            conn.execute(text("INSERT INTO schema_version (version) VALUES (:v)"), {"v": version})
    return len(MIGRATIONS)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets the API read while a pod writes; the busy timeout rides out short write locks.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


class StateStore:
    """Runs, iterations and ledger. ``StateStore("sqlite:///path.db")`` or a PostgreSQL URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine = create_engine(url)
        if url.startswith("sqlite"):
            event.listen(self._engine, "connect", _sqlite_pragmas)
        migrate(self._engine)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    def close(self) -> None:
        self._engine.dispose()

    @contextmanager
    def _session(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    # --- runs ---------------------------------------------------------------------------
    def create_run(self, run_id: str, *, name: str | None, spec: dict[str, Any]) -> RunRow:
        row = RunRow(
            id=run_id,
            name=name,
            spec=spec,
            status=RunStatus.PENDING.value,
            created_at=time.time(),
            policy_version=0,
            iterations_done=0,
            prompts_published=0,
            samples_produced=0,
            samples_trained=0,
            samples_dropped=0,
            cancel_requested=False,
            train_failures=0,
            next_train_at=0.0,
            worker_slots_used=0,
            train_launch_committed=0,
        )
        with self._session() as s:
            s.add(row)
        return row

    def get_run(self, run_id: str) -> RunRow:
        with self._session() as s:
            row = s.get(RunRow, run_id)
            if row is None:
                raise RunNotFoundError(run_id)
            return row

    def list_runs(self, *, active_only: bool = False) -> list[RunRow]:
        query = select(RunRow).order_by(RunRow.created_at)
        if active_only:
            query = query.where(RunRow.status.in_([RunStatus.PENDING.value, RunStatus.RUNNING.value]))
        with self._session() as s:
            return list(s.scalars(query))

    def update_run(self, run_id: str, **fields: Any) -> RunRow:
        """Set plain fields; status changes go through ``set_status``."""
        if "status" in fields:
            raise ValueError("use set_status() to change a run's status")
        with self._session() as s:
            row = s.get(RunRow, run_id)
            if row is None:
                raise RunNotFoundError(run_id)
            for key, value in fields.items():
                setattr(row, key, value)
            return row

    def set_status(self, run_id: str, status: RunStatus, reason: str | None = None) -> RunRow:
        now = time.time()
        with self._session() as s:
            row = s.get(RunRow, run_id, with_for_update=True)
            if row is None:
                raise RunNotFoundError(run_id)
            current = RunStatus(row.status)
            if status == current:
                return row
            if status not in _TRANSITIONS[current]:
                raise IllegalTransitionError(f"run {run_id} is {current.value}; it cannot become {status.value}")
            row.status = status.value
            row.status_reason = reason
            if status == RunStatus.RUNNING:
                row.started_at = now
            if status.is_terminal():
                row.ended_at = now
            return row

    def request_cancel(self, run_id: str) -> RunRow:
        """Mark a run for cancellation; the scheduler stops its pods and then ends it."""
        with self._session() as s:
            row = s.get(RunRow, run_id, with_for_update=True)
            if row is None:
                raise RunNotFoundError(run_id)
            if RunStatus(row.status).is_terminal():
                raise IllegalTransitionError(f"run {run_id} is already {row.status}; there is nothing to cancel")
            row.cancel_requested = True
            return row

    # --- iterations ---------------------------------------------------------------------
    def record_iteration(self, row: IterationRow, *, samples_dropped_extra: int = 0) -> None:
        """Store a finished iteration and advance the run's counters and policy pointer, atomically.

        Idempotent: recording an iteration that is already stored changes nothing.
        """
        with self._session() as s:
            if s.get(IterationRow, (row.run_id, row.iteration)) is not None:
                return
            run = s.get(RunRow, row.run_id, with_for_update=True)
            if run is None:
                raise RunNotFoundError(row.run_id)
            s.add(row)
            run.iterations_done = max(run.iterations_done, row.iteration)
            run.policy_version = max(run.policy_version, row.policy_version)
            run.samples_trained += row.samples_trained
            run.samples_dropped += row.samples_dropped + samples_dropped_extra
            run.last_mean_reward = row.mean_reward
            run.train_failures = 0
            run.next_train_at = 0.0

    def iterations(self, run_id: str) -> list[IterationRow]:
        with self._session() as s:
            return list(s.scalars(select(IterationRow).where(IterationRow.run_id == run_id).order_by(IterationRow.iteration)))

    def policy_version(self, run_id: str) -> int:
        with self._session() as s:
            version = s.scalar(select(RunRow.policy_version).where(RunRow.id == run_id))
            if version is None:
                raise RunNotFoundError(run_id)
            return version

    # --- ledger -------------------------------------------------------------------------
    def open_ledger(
        self,
        *,
        run_id: str,
        role: str,
        pod: str,
        instance_type: str,
        capacity_type: str,
        price_per_hour: float,
        price_source: str,
        started_at: float,
    ) -> None:
        """Start billing a pod. A pod that already has an open entry keeps it (idempotent)."""
        with self._session() as s:
            open_entry = s.scalar(select(LedgerRow).where(LedgerRow.pod == pod, LedgerRow.ended_at.is_(None)))
            if open_entry is not None:
                return
            s.add(
                LedgerRow(
                    run_id=run_id,
                    role=role,
                    pod=pod,
                    instance_type=instance_type,
                    capacity_type=capacity_type,
                    price_per_hour=price_per_hour,
                    price_source=price_source,
                    started_at=started_at,
                )
            )

    def close_ledger(self, pod: str, *, ended_at: float) -> None:
        """Stop billing a pod at ``ended_at``; closing an already closed pod changes nothing."""
        with self._session() as s:
            for entry in s.scalars(select(LedgerRow).where(LedgerRow.pod == pod, LedgerRow.ended_at.is_(None))):
                entry.ended_at = max(ended_at, entry.started_at)

    def ledger(self, run_id: str) -> list[LedgerEntry]:
        with self._session() as s:
            rows = s.scalars(select(LedgerRow).where(LedgerRow.run_id == run_id).order_by(LedgerRow.id))
            return [
                LedgerEntry(
                    id=r.id,
                    run_id=r.run_id,
                    role=r.role,
                    pod=r.pod,
                    instance_type=r.instance_type,
                    capacity_type=r.capacity_type,
                    price_per_hour=r.price_per_hour,
                    price_source=r.price_source,
                    started_at=r.started_at,
                    ended_at=r.ended_at,
                )
                for r in rows
            ]

    def open_ledger_count(self, run_id: str) -> int:
        with self._session() as s:
            return s.scalar(
                select(func.count()).select_from(LedgerRow).where(LedgerRow.run_id == run_id, LedgerRow.ended_at.is_(None))
            ) or 0
