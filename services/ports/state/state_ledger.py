"""The state store's cost ledger: who ran on what, for how long, at what price.

``LedgerQueries`` is a part of ``StateStore`` (``services.ports.state.state_store``), whose
transactions and run lock it uses; the concurrency notes there hold here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields

from sqlalchemy import bindparam, case, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from services.ports.state.state_schema import LedgerRow, RunRow


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
    outcome: str | None = None  # how the pod ended (``launcher.pod_outcome``); None while open or unknown

    def seconds(self, now: float) -> float:
        return max(0.0, (self.ended_at if self.ended_at is not None else now) - self.started_at)

    def dollars(self, now: float) -> float:
        return self.seconds(now) * self.price_per_hour / 3600.0


@dataclass(frozen=True)
class LedgerStamp:
    """A run's ledger as it stands, in three counts: its entries, the newest one's id, the open
    ones. Entries are only added, or changed while open (deferred, closed): a closed entry never
    changes, and none is deleted. So a ledger with no open entry is the same ledger for as long
    as its stamp is the same, and what it cost need not be computed again."""

    entries: int
    last_id: int  # 0: no entry
    open: int

    @property
    def closed(self) -> bool:
        return self.open == 0

    @classmethod
    def of(cls, entries: Sequence[LedgerEntry]) -> LedgerStamp:
        return cls(len(entries), max((e.id for e in entries), default=0), sum(e.ended_at is None for e in entries))


# Core statements, built once (building one costs more than running it): LedgerEntry's fields in
# its order, so that a row is an entry's arguments.
_ENTRY_COLUMNS = [LedgerRow.__table__.c[f.name] for f in fields(LedgerEntry)]
_LEDGERS = (
    select(*_ENTRY_COLUMNS).where(LedgerRow.run_id.in_(bindparam("run_ids", expanding=True))).order_by(LedgerRow.id)
)


def read_ledgers(conn: Connection, run_ids: Sequence[str]) -> dict[str, list[LedgerEntry]]:
    """Each run's ledger entries, oldest first, in one query for a page of runs, in the
    transaction of ``conn``; a run without entries has none. What they cost is the cost engine's
    (``services.control.cost``: each provider's billing rule), not a sum here."""
    ledgers: dict[str, list[LedgerEntry]] = {run_id: [] for run_id in run_ids}
    if run_ids:
        for row in conn.execute(_LEDGERS, {"run_ids": list(run_ids)}):
            entry = LedgerEntry(*row)
            ledgers[entry.run_id].append(entry)
    return ledgers


class LedgerQueries:
    """The ledger's queries, mixed into ``StateStore``."""

    # StateStore's: a read-only transaction, a writing one, and the lock of a run's row.
    _session: Callable[[], AbstractContextManager[Session]]
    _write: Callable[[], AbstractContextManager[Session]]
    _locked_run: Callable[[Session, str], RunRow]

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
        """Start billing a pod. A pod that already has an open entry keeps it (idempotent); the
        run's row is locked first, so two schedulers opening the same pod at once open one entry."""
        with self._write() as s:
            self._locked_run(s, run_id)
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

    def close_ledger(self, pod: str, *, ended_at: float, outcome: str | None = None) -> None:
        """Stop billing a pod at ``ended_at``, recording how it ended (``outcome``, see
        ``launcher.pod_outcome``; None: unknown); closing an already closed pod changes nothing.

        One UPDATE of the open entries only: of two closes at once, the second finds none open.
        """
        with self._write() as s:
            s.execute(
                update(LedgerRow)
                .where(LedgerRow.pod == pod, LedgerRow.ended_at.is_(None))
                .values(
                    ended_at=case((LedgerRow.started_at > ended_at, LedgerRow.started_at), else_=ended_at),
                    outcome=outcome,
                )
            )

    def defer_ledger(self, pod: str, *, started_at: float) -> None:
        """Start the pod's open entry at ``started_at`` if that is later: it had no machine before
        (``services.control.scheduler.ledger_match.DeferEntry``). A closed entry, or one starting later, is kept."""
        with self._write() as s:
            s.execute(
                update(LedgerRow)
                .where(LedgerRow.pod == pod, LedgerRow.ended_at.is_(None), LedgerRow.started_at < started_at)
                .values(started_at=started_at)
            )

    def ledger(self, run_id: str) -> list[LedgerEntry]:
        with self._session() as s:
            return read_ledgers(s.connection(), [run_id])[run_id]

    def open_ledger_count(self, run_id: str) -> int:
        with self._session() as s:
            return (
                s.scalar(
                    select(func.count())
                    .select_from(LedgerRow)
                    .where(LedgerRow.run_id == run_id, LedgerRow.ended_at.is_(None))
                )
                or 0
            )
