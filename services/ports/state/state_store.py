"""The state store: runs, iterations, the cost ledger and leases, through SQLAlchemy.

One code path for both adapters: SQLite (embedded default, a file shared by the API,
scheduler and pods on one machine) and PostgreSQL (production, ``postgresql+psycopg://...``),
chosen by the URL. Tables are in ``services.ports.state.state_schema``, their migrations (Alembic
revisions, applied when a store opens) in ``services.ports.state.migrations``, the cost
ledger's queries in ``services.ports.state.state_ledger``.

The API's reads (``run_view``, ``runs_page``, ``run_ledger``: every GET of a run, its cost or
the list) are Core statements built once, run on a connection: they build no ORM object, and a
statement built anew for every request would cost more than running it.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, overload

from sqlalchemy import String, bindparam, case, delete, func, make_url, or_, select, tuple_, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.orm import Session, sessionmaker

from contracts.status import RunStatus
from services.ports.state.migrations import migrate
from services.ports.state.state_engine import WRITE_OPTION, create_state_engine, dialect_insert
from services.ports.state.state_evals import EvalProgress, EvalQueries, read_latest_evals
from services.ports.state.state_ledger import (
    LedgerEntry,
    LedgerQueries,
    LedgerStamp,
    read_ledgers,
)
from services.ports.state.state_schema import (
    DEFAULT_TENANT,
    EvalRow,
    IterationRow,
    LeaseRow,
    LedgerRow,
    PodMemoryRow,
    RewardFailureRow,
    RunRow,
    TrackingCursorRow,
    WorkerStatsRow,
)

# Re-exported: the cost engine, the API and the simulator import LedgerEntry from here.
__all__ = [
    "EvalProgress",
    "IllegalTransitionError",
    "KnownLedgers",
    "LedgerEntry",
    "LedgerStamp",
    "ReconcileReads",
    "RunColumns",
    "RunNotFoundError",
    "RunStamp",
    "RunView",
    "StateStore",
]


@dataclass
class ReconcileReads:
    """A run's rows the scheduler's tick reads (``StateStore.reconcile_reads``)."""

    ledger: list[LedgerEntry] = field(default_factory=list)
    worker_stats: list[WorkerStatsRow] = field(default_factory=list)
    job_seconds: list[float] = field(default_factory=list)  # the last iterations', oldest first


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


def _runs_query(
    *, columns: list[Any] | None = None, active_only: bool, tenant: Any, limit: Any, after: tuple[Any, Any] | None
) -> Any:
    """Runs oldest first (the ORM's RunRow, or ``columns``): the arguments are values, or bind
    parameters of a statement built once."""
    query = select(*columns) if columns is not None else select(RunRow)
    query = query.order_by(RunRow.created_at, RunRow.id)
    if active_only:
        query = query.where(RunRow.status.in_([s.value for s in RunStatus if not s.is_terminal()]))
    if tenant is not None:
        query = query.where(RunRow.tenant == tenant)
    if after is not None:  # a row value: it seeks in the list's index (ix_runs_created_at_id)
        query = query.where(tuple_(RunRow.created_at, RunRow.id) > tuple_(*after))
    return query if limit is None else query.limit(limit)


# A run as the API reads it: the runs table's columns by name (``run.status``), as a RunRow or as
# a row of a Core query (``run_view``'s and ``runs_page``'s, lighter: no ORM object to build).
RunColumns = RunRow | Row[Any]
# The closed ledgers a reader holds the figures of: a run's stamp, or None. ``run_view``,
# ``runs_page`` and ``run_ledger`` do not read again a ledger whose stamp is still the one given.
KnownLedgers = Callable[[str], LedgerStamp | None]


def _none_known(_run_id: str) -> None:
    return None


_RUN_COLUMNS = list(RunRow.__table__.columns)


# A run's ledger stamp (``LedgerStamp``), as columns of a query of runs.
_LEDGER_STAMP_COLUMNS = [
    select(func.count()).where(LedgerRow.run_id == RunRow.id).scalar_subquery().label("ledger_entries"),
    select(func.coalesce(func.max(LedgerRow.id), 0))
    .where(LedgerRow.run_id == RunRow.id)
    .scalar_subquery()
    .label("ledger_last_id"),
    select(func.count())
    .where(LedgerRow.run_id == RunRow.id, LedgerRow.ended_at.is_(None))
    .scalar_subquery()
    .label("ledger_open"),
]
_RUN = select(*_RUN_COLUMNS, *_LEDGER_STAMP_COLUMNS).where(RunRow.id == bindparam("run_id"))
# A run as it stands (``RunStamp``): its columns and the counts of what else a view shows.
_RUN_SHOWN = select(
    *_RUN_COLUMNS,
    select(func.count()).where(IterationRow.run_id == RunRow.id).scalar_subquery().label("iterations_total"),
    *_LEDGER_STAMP_COLUMNS,
    select(func.count())
    .where(EvalRow.run_id == RunRow.id, EvalRow.mean_score.is_not(None))
    .scalar_subquery()
    .label("evals_recorded"),
    select(func.count()).where(RewardFailureRow.run_id == RunRow.id).scalar_subquery().label("reward_reasons"),
    select(func.coalesce(func.sum(RewardFailureRow.count), 0))
    .where(RewardFailureRow.run_id == RunRow.id)
    .scalar_subquery()
    .label("reward_failures_counted"),
).where(RunRow.id == bindparam("run_id"))
_LATEST_ITERATIONS = (
    select(*IterationRow.__table__.columns)
    .where(IterationRow.run_id == bindparam("run_id"))
    .order_by(IterationRow.iteration.desc())
    .limit(bindparam("latest"))
)
_REWARD_FAILURES = select(RewardFailureRow.reason, RewardFailureRow.count).where(
    RewardFailureRow.run_id == bindparam("run_id")
)
# A page of the list shows no spec: every column but it, and each run's ledger stamp.
_LISTED_COLUMNS = [c for c in _RUN_COLUMNS if c.name != "spec"] + _LEDGER_STAMP_COLUMNS
_PAGES = {
    (tenant, after): _runs_query(
        columns=_LISTED_COLUMNS,
        active_only=False,
        tenant=bindparam("tenant") if tenant else None,
        limit=bindparam("limit"),
        after=(bindparam("after_created_at"), bindparam("after_id")) if after else None,
    )
    for tenant in (False, True)
    for after in (False, True)
}


def _read_ledgers(
    conn: Connection, stamps: Mapping[str, LedgerStamp], known: KnownLedgers
) -> dict[str, list[LedgerEntry] | None]:
    """Each run's ledger, oldest first, or None where its stamp (in ``stamps``, as read in this
    transaction) is that of the closed ledger ``known`` gives."""
    unknown = [run_id for run_id, stamp in stamps.items() if not stamp.closed or known(run_id) != stamp]
    ledgers = read_ledgers(conn, unknown)
    return {run_id: ledgers.get(run_id) for run_id in stamps}


@dataclass(frozen=True)
class RunStamp:
    """A run as it stands: its columns, and counts of everything else a view of it shows, each of
    which moves whenever what it counts does: iterations recorded and held-out evals recorded
    (each only ever added, and never changed), reward failure reasons and their total (counters
    that only grow), and its ledger's ``LedgerStamp``. Two reads of a run with equal stamps show
    the same run, but for what an open ledger has cost by then."""

    row: Row[Any]  # the run's columns, then iterations_total, ledger_*, evals_recorded, reward_*

    @property
    def ledger(self) -> LedgerStamp:
        return _ledger_stamp(self.row)


def _ledger_stamp(row: Row[Any]) -> LedgerStamp:
    """The ledger stamp of a run read with ``_LEDGER_STAMP_COLUMNS``."""
    columns = row._mapping  # not attributes: a Core row finds those after raising AttributeError
    return LedgerStamp(columns["ledger_entries"], columns["ledger_last_id"], columns["ledger_open"])


@dataclass(frozen=True)
class RunView:
    """A run as the API shows it, read in one transaction: its row, its latest iterations in
    order, how many iterations it has in all, and its ledger (whose bill is the cost engine's),
    or None where it is the closed ledger the reader knows (``KnownLedgers``). The run, its
    iterations and evals are rows of their tables' columns, read by name; ``stamp`` is what the
    run stood at (None for a view not read from the store)."""

    run: RunColumns
    latest: list[Any]  # rows of IterationRow's columns
    iterations_total: int
    ledger: list[LedgerEntry] | None
    reward_failures: dict[str, int]  # failed reward computations by ``<fn>:<kind>``
    # Its latest recorded held-out evals (EvalRow's columns), by policy version.
    evals: list[Any] = field(default_factory=list)
    stamp: RunStamp | None = None


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

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        """A read-only transaction on a connection, for Core statements (the API's reads)."""
        with self._engine.begin() as conn:
            yield conn

    def run_stamp(self, run_id: str) -> RunStamp:
        """What the run stands at (``RunStamp``): one statement."""
        with self._reading() as conn:
            return _run_stamp(conn, run_id)

    @overload
    def run_view(self, run_id: str, *, latest: int, known: KnownLedgers = ..., unless_at: None = None) -> RunView: ...
    @overload
    def run_view(
        self, run_id: str, *, latest: int, known: KnownLedgers = ..., unless_at: RunStamp
    ) -> RunView | None: ...
    def run_view(
        self, run_id: str, *, latest: int, known: KnownLedgers = _none_known, unless_at: RunStamp | None = None
    ) -> RunView | None:
        """The run with its ``latest`` iterations, their count and its ledger (None where
        ``known`` gives its stamp): one read transaction (a GET of a run is the API's commonest request).
        None where the run still stands at ``unless_at``, the stamp of a view read before: then the
        transaction is the one statement that reads the stamp."""
        with self._reading() as conn:
            stamp = _run_stamp(conn, run_id)
            if stamp == unless_at:
                return None
            iterations = conn.execute(_LATEST_ITERATIONS, {"run_id": run_id, "latest": latest}).all()
            reasons = dict(conn.execute(_REWARD_FAILURES, {"run_id": run_id}).all()) if stamp.row.reward_reasons else {}
            evals = read_latest_evals(conn, run_id, latest) if stamp.row.evals_recorded else []
            return RunView(
                stamp.row,
                list(reversed(iterations)),
                stamp.row.iterations_total,
                _read_ledgers(conn, {run_id: stamp.ledger}, known)[run_id],
                reasons,
                evals=evals,
                stamp=stamp,
            )

    def run_ledger(
        self, run_id: str, *, known: KnownLedgers = _none_known
    ) -> tuple[RunColumns, list[LedgerEntry] | None]:
        """The run's row and its ledger (None where ``known`` gives its stamp), in one read transaction."""
        with self._reading() as conn:
            row = conn.execute(_RUN, {"run_id": run_id}).first()
            if row is None:
                raise RunNotFoundError(run_id)
            return row, _read_ledgers(conn, {run_id: _ledger_stamp(row)}, known)[run_id]

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
        self,
        *,
        tenant: str | None,
        limit: int,
        after: tuple[float, str] | None,
        known: KnownLedgers = _none_known,
    ) -> list[tuple[RunColumns, list[LedgerEntry] | None]]:
        """``list_runs`` of ``tenant`` (each run's columns but its spec) with each run's ledger
        (None where ``known`` gives its stamp), in one read transaction."""
        params: dict[str, Any] = {"limit": limit, "tenant": tenant}
        if after is not None:
            params["after_created_at"], params["after_id"] = after
        with self._reading() as conn:
            rows = conn.execute(_PAGES[tenant is not None, after is not None], params).all()
            ledgers = _read_ledgers(conn, {r.id: _ledger_stamp(r) for r in rows}, known)
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

    def request_cancel(self, run_id: str, *, tenant: str | None = None) -> RunRow:
        """Cancel a run: it reads CANCELLING while the scheduler stops its pods, then CANCELLED.
        With ``tenant``, a run of another tenant is not found (RunNotFoundError), and left as it is."""
        with self._write() as s:
            row = _locked_run(s, run_id)
            if tenant is not None and row.tenant != tenant:
                raise RunNotFoundError(run_id)
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

    def reconcile_reads(self, run_ids: Sequence[str], job_window: int) -> dict[str, ReconcileReads]:
        """What the scheduler reads of each run every tick, for all of ``run_ids`` in three
        queries, however many runs: ledgers, rollout workers' counters, and the seconds of each
        run's last ``job_window`` iterations (bounded by the run's last iteration number, so a long
        history is not read)."""
        reads = {run_id: ReconcileReads() for run_id in run_ids}
        if not reads:
            return reads
        ids = list(reads)
        with self._session() as s:
            for run_id, entries in read_ledgers(s.connection(), ids).items():
                reads[run_id].ledger.extend(entries)
            stats = select(WorkerStatsRow).where(WorkerStatsRow.run_id.in_(ids)).order_by(WorkerStatsRow.worker)
            for w in s.scalars(stats):
                reads[w.run_id].worker_stats.append(w)
            recent = (
                select(IterationRow.run_id, IterationRow.seconds)
                .join(RunRow, RunRow.id == IterationRow.run_id)
                .where(RunRow.id.in_(ids), IterationRow.iteration > RunRow.iterations_done - job_window)
                .order_by(IterationRow.run_id, IterationRow.iteration)
            )
            for run_id, seconds in s.execute(recent):
                reads[run_id].job_seconds.append(seconds)
        return reads

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
        generation_batch: int | None = None,
    ) -> None:
        """Add a rollout worker's work since its last report to its counters (one upsert, no
        read: workers report after every batch). ``reward_cache`` holds keys by result (hit,
        miss, error). Adding, not setting: a restarted worker of the same name continues them.
        ``generation_batch``, the sequences generated at once in the batch, is set, not added."""
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
                run_id=run_id, worker=worker, reported_at=now, generation_batch=generation_batch, **added
            )
            conn.execute(
                upsert.on_conflict_do_update(
                    index_elements=[WorkerStatsRow.run_id, WorkerStatsRow.worker],
                    set_={
                        **{name: getattr(WorkerStatsRow, name) + getattr(upsert.excluded, name) for name in added},
                        "reported_at": upsert.excluded.reported_at,
                        "generation_batch": upsert.excluded.generation_batch,
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


def _run_stamp(conn: Connection, run_id: str) -> RunStamp:
    row = conn.execute(_RUN_SHOWN, {"run_id": run_id}).first()
    if row is None:
        raise RunNotFoundError(run_id)
    return RunStamp(row)


def _reward_failures(s: Session, run_id: str) -> dict[str, int]:
    # .all(): rows of (reason, count); dict() would take the Result itself, with its keys(), for a mapping.
    return dict(s.connection().execute(_REWARD_FAILURES, {"run_id": run_id}).all())
