"""The state store: runs, iterations, the cost ledger and leases, through SQLAlchemy.

One code path for both adapters: SQLite (embedded default, a file shared by the API,
scheduler and pods on one machine) and PostgreSQL (production, ``postgresql+psycopg://...``),
chosen by the URL. Tables are in ``services.ports.state.state_schema``, their migrations (Alembic
revisions, applied when a store opens) in ``services.ports.state.migrations``, the cost
ledger's queries in ``services.ports.state.state_ledger``.

Concurrency: any number of processes (API replicas, schedulers, pods) share one store. Every
read-modify-write of a run first locks the run's row (``SELECT ... FOR UPDATE``), so two writers
of one run take turns and each decides on what the other wrote; leases are one atomic upsert.
On PostgreSQL sessions are READ COMMITTED whatever the server's default, so a statement after
a lock wait sees what the lock's previous holder committed. SQLite has no row locks: there a
writing session takes the file's write lock when it begins (``BEGIN IMMEDIATE``) and a reading
one reads one snapshot (``BEGIN``), rather than pysqlite's default of running the reads before a
write outside any transaction.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import String, and_, case, delete, func, make_url, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from contracts.status import RunStatus
from services.ports.state.migrations import migrate
from services.ports.state.state_engine import WRITE_OPTION, create_state_engine, dialect_insert
from services.ports.state.state_evals import EvalProgress, EvalQueries, recorded_evals
from services.ports.state.state_ledger import LedgerEntry, LedgerQueries
from services.ports.state.state_schema import (
    DEFAULT_TENANT,
    EvalRow,
    IterationRow,
    LeaseRow,
    PodMemoryRow,
    RewardFailureRow,
    RunRow,
    TrackingCursorRow,
    WorkerStatsRow,
)

# Re-exported: the cost engine, the API and the simulator import LedgerEntry from here.
__all__ = ["EvalProgress", "IllegalTransitionError", "LedgerEntry", "RunNotFoundError", "RunView", "StateStore"]


class IllegalTransitionError(Exception):
    """A status change the run's current status does not allow (the API answers 409)."""


class RunNotFoundError(KeyError):
    """No run with that id (the API answers 404)."""


def _locked_run(s: Session, run_id: str) -> RunRow:
    """The run's row, locked until the transaction ends (PostgreSQL: ``FOR UPDATE``; SQLite: the
    writing session holds the file's write lock already, and SQLAlchemy leaves the clause out)."""
    row = s.get(RunRow, run_id, with_for_update=True)
    if row is None:
        raise RunNotFoundError(run_id)
    return row


def _runs_query(*, active_only: bool, tenant: str | None, limit: int | None, after: tuple[float, str] | None) -> Any:
    query = select(RunRow).order_by(RunRow.created_at, RunRow.id)
    if active_only:
        query = query.where(RunRow.status.in_([s.value for s in RunStatus if not s.is_terminal()]))
    if tenant is not None:
        query = query.where(RunRow.tenant == tenant)
    if after is not None:
        created_at, run_id = after
        query = query.where(
            or_(RunRow.created_at > created_at, and_(RunRow.created_at == created_at, RunRow.id > run_id))
        )
    return query if limit is None else query.limit(limit)


def _latest_iterations(s: Session, run_id: str, latest: int) -> list[IterationRow]:
    """The run's last ``latest`` iterations, in order (read as such, newest first, then turned)."""
    query = (
        select(IterationRow).where(IterationRow.run_id == run_id).order_by(IterationRow.iteration.desc()).limit(latest)
    )
    return list(reversed(s.scalars(query).all()))


def _iteration_count(s: Session, run_id: str) -> int:
    return s.scalar(select(func.count()).select_from(IterationRow).where(IterationRow.run_id == run_id)) or 0


@dataclass(frozen=True)
class RunView:
    """A run as the API shows it, read in one transaction: its row, its latest iterations in
    order, how many iterations it has in all, and its ledger (whose bill is the cost engine's)."""

    run: RunRow
    latest: list[IterationRow]
    iterations_total: int
    ledger: list[LedgerEntry]
    reward_failures: dict[str, int]  # failed reward computations by ``<fn>:<kind>``
    evals: list[EvalRow] = field(default_factory=list)  # its latest recorded held-out evals, by policy version


class StateStore(LedgerQueries, EvalQueries):
    """Runs, iterations, ledger and held-out evals. ``StateStore("sqlite:///path.db")`` or a PostgreSQL URL."""

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        # What messages and logs show: the URL with its password masked (``***``).
        self.url = parsed.render_as_string(hide_password=True)
        self._engine = create_state_engine(parsed)
        self._write_engine = self._engine.execution_options(**{WRITE_OPTION: True})
        migrate(self._write_engine)
        self._reads = sessionmaker(self._engine, expire_on_commit=False)
        self._writes = sessionmaker(self._write_engine, expire_on_commit=False)

    def __repr__(self) -> str:
        return f"StateStore({self.url!r})"

    def close(self) -> None:
        self._engine.dispose()

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """A read-only transaction."""
        with self._reads.begin() as session:
            yield session

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """A transaction that writes (on SQLite: holding the write lock from its start)."""
        with self._writes.begin() as session:
            yield session

    # The run lock, as the ledger's queries (``LedgerQueries``, another module) reach it.
    _locked_run = staticmethod(_locked_run)

    # --- runs ---------------------------------------------------------------------------
    def create_run(
        self,
        run_id: str,
        *,
        name: str | None,
        spec: dict[str, Any],
        tenant: str = DEFAULT_TENANT,
        prompt_count: int = 0,
    ) -> RunRow:
        # Every other column starts at its model default (state_schema), set at the INSERT.
        row = RunRow(
            id=run_id,
            tenant=tenant,
            name=name,
            prompt_count=prompt_count,
            spec=spec,
            status=RunStatus.PENDING.value,
            created_at=time.time(),
        )
        with self._write() as s:
            s.add(row)
        return row

    def get_run(self, run_id: str) -> RunRow:
        with self._session() as s:
            row = s.get(RunRow, run_id)
            if row is None:
                raise RunNotFoundError(run_id)
            return row

    def run_view(self, run_id: str, *, latest: int) -> RunView:
        """The run with its ``latest`` iterations, their count and its ledger: one read
        transaction (a GET of a run is the API's commonest request)."""
        with self._session() as s:
            row = s.get(RunRow, run_id)
            if row is None:
                raise RunNotFoundError(run_id)
            return RunView(
                row,
                _latest_iterations(s, run_id, latest),
                _iteration_count(s, run_id),
                self._ledgers(s, [run_id])[run_id],
                _reward_failures(s, run_id),
                evals=recorded_evals(s, run_id, latest),
            )

    def list_runs(
        self,
        *,
        active_only: bool = False,
        tenant: str | None = None,
        limit: int | None = None,
        after: tuple[float, str] | None = None,
    ) -> list[RunRow]:
        """Runs oldest first; of one ``tenant`` (None: all); at most ``limit``; those after the
        (created_at, id) of ``after``, the last run of the previous page."""
        with self._session() as s:
            return list(s.scalars(_runs_query(active_only=active_only, tenant=tenant, limit=limit, after=after)))

    def runs_page(
        self, *, tenant: str | None, limit: int, after: tuple[float, str] | None
    ) -> list[tuple[RunRow, list[LedgerEntry]]]:
        """``list_runs`` of ``tenant`` with each run's ledger, in one read transaction."""
        with self._session() as s:
            rows = list(s.scalars(_runs_query(active_only=False, tenant=tenant, limit=limit, after=after)))
            ledgers = self._ledgers(s, [r.id for r in rows])
        return [(r, ledgers[r.id]) for r in rows]

    def update_run(self, run_id: str, **fields: Any) -> RunRow:
        """Set plain fields; status changes go through ``set_status`` and ``begin_ending``."""
        if "status" in fields:
            raise ValueError("use set_status() or begin_ending() to change a run's status")
        with self._write() as s:
            row = _locked_run(s, run_id)
            for key, value in fields.items():
                setattr(row, key, _clipped(key, value))
            return row

    def set_status(self, run_id: str, status: RunStatus, reason: str | None = None) -> RunRow:
        """Start a run (RUNNING) or end it (a terminal status); stopping goes through ``begin_ending``."""
        if status.is_stopping():
            raise ValueError(f"use begin_ending() to make a run {status.value}: it needs the status it ends with")
        now = time.time()
        with self._write() as s:
            row = _locked_run(s, run_id)
            current = RunStatus(row.status)
            if status == current:
                return row
            if not current.can_become(status):
                raise IllegalTransitionError(f"run {run_id} is {current.value}; it cannot become {status.value}")
            row.status = status.value
            row.status_reason = _clipped("status_reason", reason)
            if status == RunStatus.RUNNING:
                row.started_at = now
            if status.is_terminal():
                row.ended_at = now
            return row

    def begin_ending(self, run_id: str, status: RunStatus, reason: str) -> RunRow:
        """Decide that a run ends with the terminal ``status``: it reads CANCELLING or ENDING
        while the scheduler stops its pods. See ``_begin_ending`` for which decision stands."""
        with self._write() as s:
            return _begin_ending(_locked_run(s, run_id), status, reason)

    def request_cancel(self, run_id: str) -> RunRow:
        """Cancel a run: it reads CANCELLING while the scheduler stops its pods, then CANCELLED."""
        with self._write() as s:
            row = _locked_run(s, run_id)
            current = RunStatus(row.status)
            if current.is_terminal():
                raise IllegalTransitionError(f"run {run_id} is already {row.status}; there is nothing to cancel")
            reason = "cancelled before it started" if current == RunStatus.PENDING else "cancelled by the user"
            return _begin_ending(row, RunStatus.CANCELLED, reason)

    def count_reward_failures(self, run_id: str, by_reason: Mapping[str, int], latest: str) -> None:
        """Add failed or timed-out reward computations to the run: ``by_reason`` counts them by
        ``<fn>:<kind>``; ``latest`` says why the latest failed."""
        with self._write() as s:
            s.execute(
                update(RunRow)
                .where(RunRow.id == run_id)
                .values(
                    reward_failures=RunRow.reward_failures + sum(by_reason.values()),
                    last_reward_error=_clipped("last_reward_error", latest),
                )
            )
            insert = dialect_insert(s.get_bind().dialect.name)(RewardFailureRow)
            for reason, count in by_reason.items():
                upsert = insert.values(run_id=run_id, reason=reason[:64], count=count)
                s.execute(
                    upsert.on_conflict_do_update(
                        index_elements=[RewardFailureRow.run_id, RewardFailureRow.reason],
                        set_={"count": RewardFailureRow.count + upsert.excluded.count},
                    )
                )

    def report_memory(self, run_id: str, pod: str, role: str, *, at: float, current: float, peak: float) -> None:
        """Record a pod's memory (bytes) at ``at``: its GPU memory where it has a GPU, else its RSS."""
        with self._write() as s:
            s.add(PodMemoryRow(run_id=run_id, pod=pod[:128], role=role[:16], at=at, bytes=current, peak_bytes=peak))

    def pod_memory(self, run_id: str, *, since: float = 0.0, until: float = float("inf")) -> list[PodMemoryRow]:
        """The run's memory reports taken after ``since`` and up to ``until`` (unix seconds), in order."""
        with self._session() as s:
            return list(
                s.scalars(
                    select(PodMemoryRow)
                    .where(PodMemoryRow.run_id == run_id, PodMemoryRow.at > since, PodMemoryRow.at <= until)
                    .order_by(PodMemoryRow.at, PodMemoryRow.id)
                )
            )

    def reward_failures(self, run_id: str) -> dict[str, int]:
        """The run's failed reward computations by ``<fn>:<kind>``."""
        with self._session() as s:
            return _reward_failures(s, run_id)

    def count_filtered_samples(self, run_id: str, count: int) -> None:
        """Add ``count`` samples a rollout worker dropped before queueing them (dynamic sampling) to
        the run's ``samples_filtered``: a counter of its own, which the scheduler's recount of
        ``samples_dropped`` (queued samples never trained) leaves alone."""
        with self._write() as s:
            s.execute(
                update(RunRow).where(RunRow.id == run_id).values(samples_filtered=RunRow.samples_filtered + count)
            )

    def runs_with_expired_queues(self, ended_before: float, limit: int) -> list[str]:
        """Ended runs (before ``ended_before``) whose queue topics are still there, oldest first."""
        terminal = [s.value for s in RunStatus if s.is_terminal()]
        with self._session() as s:
            return list(
                s.scalars(
                    select(RunRow.id)
                    .where(
                        RunRow.status.in_(terminal), RunRow.queues_deleted.is_(False), RunRow.ended_at < ended_before
                    )
                    .order_by(RunRow.ended_at)
                    .limit(limit)
                )
            )

    # --- iterations ---------------------------------------------------------------------
    def record_iteration(self, row: IterationRow, *, samples_dropped_extra: int = 0) -> None:
        """Store a finished iteration and advance the run's counters and policy pointer, atomically.

        Idempotent: recording an iteration that is already stored changes nothing, also when two
        schedulers record it at once (an old leader finishing its tick beside the new one): the
        run's row is locked before the iteration is looked for, so the second finds the first's.
        """
        with self._write() as s:
            run = _locked_run(s, row.run_id)
            if s.get(IterationRow, (row.run_id, row.iteration)) is not None:
                return
            s.add(row)
            run.iterations_done = max(run.iterations_done, row.iteration)
            run.policy_version = max(run.policy_version, row.policy_version)
            run.samples_trained += row.samples_trained
            run.samples_dropped += row.samples_dropped + samples_dropped_extra
            run.last_mean_reward = row.mean_reward
            run.train_failures = 0
            run.next_train_at = 0.0

    def iterations(self, run_id: str, *, after: int = 0, limit: int | None = None) -> list[IterationRow]:
        """The run's iterations in order (the API reads only the latest, through ``run_view``); only
        those after iteration ``after``, at most ``limit`` of them, when given."""
        with self._session() as s:
            query = select(IterationRow).where(IterationRow.run_id == run_id, IterationRow.iteration > after)
            return list(s.scalars(query.order_by(IterationRow.iteration).limit(limit)))

    def reward_url(self, run_id: str) -> str | None:
        """Where the run's reward server listens now, as it last said; None before it has (a
        column alone: rollout workers ask before every batch)."""
        with self._session() as s:
            return s.scalar(select(RunRow.reward_url).where(RunRow.id == run_id))

    def policy_version(self, run_id: str) -> int:
        with self._session() as s:
            version = s.scalar(select(RunRow.policy_version).where(RunRow.id == run_id))
            if version is None:
                raise RunNotFoundError(run_id)
            return version

    # --- experiment trackers' cursors (services.control.tracking) -------------------------------
    def tracking_cursors(self, run_id: str) -> dict[str, TrackingCursorRow]:
        """What each tracker has of the run, by sink name; a sink without a row has nothing yet."""
        with self._session() as s:
            return {c.sink: c for c in s.scalars(select(TrackingCursorRow).where(TrackingCursorRow.run_id == run_id))}

    def advance_tracking_cursor(
        self, run_id: str, sink: str, *, iteration: int, eval_version: int, ended: bool = False
    ) -> None:
        """Record that ``sink`` has the run's iterations through ``iteration`` and evaluations through
        ``eval_version`` (and its end, with ``ended``). One upsert, only forward: a cursor never moves back."""
        with self._write_engine.begin() as conn:
            upsert = dialect_insert(conn.dialect.name)(TrackingCursorRow).values(
                run_id=run_id, sink=sink, iteration=iteration, eval_version=eval_version, ended=ended
            )
            conn.execute(
                upsert.on_conflict_do_update(
                    index_elements=[TrackingCursorRow.run_id, TrackingCursorRow.sink],
                    set_={
                        "iteration": case(
                            (upsert.excluded.iteration > TrackingCursorRow.iteration, upsert.excluded.iteration),
                            else_=TrackingCursorRow.iteration,
                        ),
                        "eval_version": case(
                            (
                                upsert.excluded.eval_version > TrackingCursorRow.eval_version,
                                upsert.excluded.eval_version,
                            ),
                            else_=TrackingCursorRow.eval_version,
                        ),
                        "ended": or_(TrackingCursorRow.ended, upsert.excluded.ended),
                    },
                )
            )

    def runs_with_tracking_to_end(self, limit: int) -> list[str]:
        """Ended runs (a terminal status) that some tracker has not been told the end of, oldest end first."""
        terminal = [s.value for s in RunStatus if s.is_terminal()]
        with self._session() as s:
            return list(
                s.scalars(
                    select(RunRow.id)
                    .where(
                        RunRow.status.in_(terminal),
                        RunRow.id.in_(select(TrackingCursorRow.run_id).where(TrackingCursorRow.ended.is_(False))),
                    )
                    .order_by(RunRow.ended_at)
                    .limit(limit)
                )
            )

    # --- rollout workers' counters ------------------------------------------------------
    def report_worker(
        self,
        run_id: str,
        worker: str,
        *,
        samples: int,
        generation_seconds: float,
        reward_cache: dict[str, int],
    ) -> None:
        """Add a rollout worker's work since its last report to its counters (one upsert, no
        read: workers report after every batch). ``reward_cache`` holds keys by result (hit,
        miss, error). Adding, not setting: a restarted worker of the same name continues them."""
        now = time.time()
        added = {
            "samples_produced": samples,
            "generation_seconds": generation_seconds,
            "reward_cache_hits": reward_cache.get("hit", 0),
            "reward_cache_misses": reward_cache.get("miss", 0),
            "reward_cache_errors": reward_cache.get("error", 0),
        }
        with self._write_engine.begin() as conn:
            upsert = dialect_insert(conn.dialect.name)(WorkerStatsRow).values(
                run_id=run_id, worker=worker, reported_at=now, **added
            )
            conn.execute(
                upsert.on_conflict_do_update(
                    index_elements=[WorkerStatsRow.run_id, WorkerStatsRow.worker],
                    set_={
                        **{name: getattr(WorkerStatsRow, name) + getattr(upsert.excluded, name) for name in added},
                        "reported_at": upsert.excluded.reported_at,
                    },
                )
            )

    def worker_stats(self, run_id: str) -> list[WorkerStatsRow]:
        """The run's rollout workers' counters, by worker name."""
        with self._session() as s:
            return list(
                s.scalars(select(WorkerStatsRow).where(WorkerStatsRow.run_id == run_id).order_by(WorkerStatsRow.worker))
            )

    # --- leases -------------------------------------------------------------------------
    def acquire_lease(self, name: str, holder: str, seconds: float) -> bool:
        """Take or renew the lease ``name`` for ``seconds``; True when ``holder`` holds it now.

        A compare-and-set in one statement, an upsert: it inserts a missing lease, or updates one
        that ``holder`` has or that expired, and otherwise changes nothing (a row returned: held).
        Of contenders at once the first takes the row's lock and wins; each other one then finds
        the lease held by the winner (PostgreSQL re-checks the condition on the row it waited for).
        Expiry is wall-clock time of the callers: their clocks must agree to well within ``seconds``.
        """
        now = time.time()
        with self._write_engine.begin() as conn:
            upsert = dialect_insert(conn.dialect.name)(LeaseRow).values(
                name=name, holder=holder, expires_at=now + seconds
            )
            upsert = upsert.on_conflict_do_update(
                index_elements=[LeaseRow.name],
                set_={"holder": upsert.excluded.holder, "expires_at": upsert.excluded.expires_at},
                where=or_(LeaseRow.holder == holder, LeaseRow.expires_at < now),
            )
            return conn.execute(upsert.returning(LeaseRow.holder)).first() is not None

    def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up so that another holder takes it at once; a lease not held is left alone."""
        with self._write_engine.begin() as conn:
            conn.execute(delete(LeaseRow).where(LeaseRow.name == name, LeaseRow.holder == holder))

    def lease_holder(self, name: str) -> str | None:
        """Who holds the lease ``name`` now; None when nobody does (never taken, released or expired)."""
        with self._session() as s:
            lease = s.get(LeaseRow, name)
            return lease.holder if lease is not None and lease.expires_at >= time.time() else None


# Messages stored with a run, clipped to their columns' width: SQLite would keep a longer one,
# PostgreSQL refuses it (and with it the status change it came with).
_TEXT_WIDTHS = {
    name: RunRow.__table__.c[name].type.length
    for name in ("status_reason", "ending_reason", "last_error", "last_reward_error")
    if isinstance(RunRow.__table__.c[name].type, String)
}


def _clipped(column: str, value: Any) -> Any:
    width = _TEXT_WIDTHS.get(column)
    return value[:width] if width is not None and isinstance(value, str) else value


def _begin_ending(row: RunRow, status: RunStatus, reason: str) -> RunRow:
    """Mark ``row`` stopping, to end as ``status``. The first decision stands (a cancel of an
    ENDING run changes nothing), except that a failure replaces any other: a run that cannot go
    on is never reported cancelled or succeeded. An ended run is left as it is."""
    if not status.is_terminal():
        raise ValueError(f"a run ends with a terminal status, not {status.value}")
    current = RunStatus(row.status)
    if current.is_terminal():
        return row
    if current.is_stopping() and not (status == RunStatus.FAILED and row.ending_status != RunStatus.FAILED.value):
        return row
    stopping = RunStatus.CANCELLING if status == RunStatus.CANCELLED else RunStatus.ENDING
    if stopping != current and not current.can_become(stopping):
        raise IllegalTransitionError(f"run {row.id} is {current.value}; it cannot become {stopping.value}")
    row.status = stopping.value
    row.status_reason = _clipped("status_reason", reason)
    row.ending_status = status.value
    row.ending_reason = _clipped("ending_reason", reason)
    return row


def _reward_failures(s: Session, run_id: str) -> dict[str, int]:
    rows = s.execute(select(RewardFailureRow.reason, RewardFailureRow.count).where(RewardFailureRow.run_id == run_id))
    # .all(): rows of (reason, count); dict() would take the Result itself, with its keys(), for a mapping.
    return dict(rows.all())
