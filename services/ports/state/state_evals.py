"""The state store's held-out evals: each policy version's eval, opened as its eval pod launches,
then recorded from the pod's result, or failed and retried until given up (``services.control.scheduler.evals``).

``EvalQueries`` is a part of ``StateStore`` (``services.ports.state.state_store``), whose
transactions and run lock it uses; the concurrency notes there hold here too.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.orm import Session

from contracts.evaluation import EvalResult
from services.ports.state.state_engine import dialect_insert
from services.ports.state.state_schema import EvalRow, RunRow


@dataclass(frozen=True)
class EvalProgress:
    """Where a run's held-out evals stand, read in one transaction for the scheduler's tick."""

    launched_through: int  # the highest policy version an eval was opened for; -1: none yet
    open: list[EvalRow]  # opened, neither recorded nor given up, by version
    best: EvalRow | None  # the recorded eval of the highest mean score
    given_up: EvalRow | None  # the latest eval given up (its ``error`` says why)


def recorded_evals(s: Session, run_id: str, latest: int | None = None) -> list[EvalRow]:
    """The run's recorded evals by policy version, in the transaction ``s``; only the last
    ``latest`` of them when given (read as such, newest first, then turned)."""
    query = select(EvalRow).where(EvalRow.run_id == run_id, EvalRow.mean_score.is_not(None))
    if latest is None:
        return list(s.scalars(query.order_by(EvalRow.policy_version)))
    return list(reversed(s.scalars(query.order_by(EvalRow.policy_version.desc()).limit(latest)).all()))


# The API's read of them: a Core statement built once (building one costs more than running it).
_LATEST_RECORDED = (
    select(*EvalRow.__table__.columns)
    .where(EvalRow.run_id == bindparam("run_id"), EvalRow.mean_score.is_not(None))
    .order_by(EvalRow.policy_version.desc())
    .limit(bindparam("latest"))
)


def read_latest_evals(conn: Connection, run_id: str, latest: int) -> list[Row[Any]]:
    """``recorded_evals(s, run_id, latest)`` as rows of the evals' columns (by name: ``row.mean_score``),
    in the transaction of ``conn``."""
    return list(reversed(conn.execute(_LATEST_RECORDED, {"run_id": run_id, "latest": latest}).all()))


class EvalQueries:
    """The evals' queries, mixed into ``StateStore``."""

    # StateStore's: its writing engine, a read-only transaction, a writing one, and the lock of a run's row.
    _write_engine: Engine
    _session: Callable[[], AbstractContextManager[Session]]
    _write: Callable[[], AbstractContextManager[Session]]
    _locked_run: Callable[[Session, str], RunRow]

    def open_eval(self, run_id: str, version: int, *, launched_at: float) -> None:
        """Open the eval of policy ``version`` as its first pod is launched; an eval already open
        (a relaunch, or two schedulers at once) is left as it is."""
        with self._write_engine.begin() as conn:
            insert = dialect_insert(conn.dialect.name)(EvalRow).values(
                run_id=run_id, policy_version=version, launched_at=launched_at, failures=0, retry_at=0.0, given_up=False
            )
            conn.execute(insert.on_conflict_do_nothing(index_elements=[EvalRow.run_id, EvalRow.policy_version]))

    def record_eval(self, run_id: str, result: EvalResult) -> None:
        """Store an eval pod's result. Idempotent: an eval already recorded is left as it is."""
        with self._write() as s:
            self._locked_run(s, run_id)
            row = s.get(EvalRow, (run_id, result.policy_version))
            if row is None:  # opened by nothing that survived (the row is written before the pod is launched)
                row = EvalRow(
                    run_id=run_id,
                    policy_version=result.policy_version,
                    launched_at=result.ended_at - result.seconds,
                    failures=0,
                    retry_at=0.0,
                    given_up=False,
                )
                s.add(row)
            if row.mean_score is not None:
                return
            row.mean_score = result.mean_score
            row.metrics = dict(result.metrics)
            row.prompts = result.prompts
            row.samples = result.samples
            row.seconds = result.seconds
            row.ended_at = result.ended_at

    def fail_eval(
        self, run_id: str, version: int, *, failures: int, retry_at: float, gave_up: str | None = None
    ) -> None:
        """Count a failed eval pod of ``version``: retried from ``retry_at``, or, with ``gave_up``
        (the reason), never again."""
        with self._write() as s:
            s.execute(
                update(EvalRow)
                .where(EvalRow.run_id == run_id, EvalRow.policy_version == version)
                .values(
                    failures=failures,
                    retry_at=retry_at,
                    given_up=gave_up is not None,
                    error=None if gave_up is None else gave_up[:500],
                )
            )

    def eval_progress(self, run_id: str) -> EvalProgress:
        """The run's evals as the scheduler plans with them (``EvalProgress``)."""
        with self._session() as s:
            of_run = EvalRow.run_id == run_id
            through = s.scalar(select(func.max(EvalRow.policy_version)).where(of_run))
            pending = s.scalars(
                select(EvalRow)
                .where(of_run, EvalRow.mean_score.is_(None), EvalRow.given_up.is_(False))
                .order_by(EvalRow.policy_version)
            )
            best = s.scalars(
                select(EvalRow)
                .where(of_run, EvalRow.mean_score.is_not(None))
                .order_by(EvalRow.mean_score.desc(), EvalRow.policy_version)
                .limit(1)
            ).first()
            given_up = s.scalars(
                select(EvalRow)
                .where(of_run, EvalRow.given_up.is_(True))
                .order_by(EvalRow.policy_version.desc())
                .limit(1)
            ).first()
            return EvalProgress(-1 if through is None else through, list(pending), best, given_up)

    def evals(self, run_id: str, latest: int | None = None) -> list[EvalRow]:
        """The run's recorded evals by policy version; only the last ``latest`` of them when given."""
        with self._session() as s:
            return recorded_evals(s, run_id, latest)
