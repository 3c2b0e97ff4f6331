"""The sync: each run's new figures, from the state store to the trackers its spec names.

Every tracker (sink) of a run has a cursor in the state store (``tracking_cursors``): the last
iteration and the last evaluated policy version it has. A sync sends what lies beyond the cursor,
then advances it; a run that has ended and whose every figure is sent gets its end sent, and its
cursor is marked ended. Send first, advance after: a scheduler that dies between the two sends
the same points again from a fresh process (at least once), and each sink makes that repeat
harmless where its tracker allows (see each sink's module): none repeats a point.

Example, a run logging to TensorBoard and MLflow, MLflow down for a while:

- iterations 1-3 recorded; a sync writes them to both, both cursors reach 3;
- iteration 4 recorded, MLflow down: TensorBoard's cursor reaches 4, MLflow's stays at 3, and
  the sync raises ``TrackingError`` naming MLflow; a later sync sends MLflow iteration 4;
- the run succeeds: the next sync sends what is left, then the end (MLflow: run FINISHED), and
  both cursors are marked ended: later syncs do nothing for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from contracts.status import RunStatus
from services.control.tracking.points import Point, dollars_at, eval_point, iteration_point, memory_figures
from services.control.tracking.sink import Sink, TrackingError
from services.control.tracking.sinks import SinkSet
from services.domain.runspec import Tracking
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_schema import IterationRow, RunRow, TrackingCursorRow
from services.ports.state.state_store import LedgerEntry, StateStore

log = logging.getLogger(__name__)

# Iterations one sync sends a sink at most: a run far behind (a tracker down for long) catches up
# over several syncs, each bounded like the rest of a scheduler tick.
BATCH_ITERATIONS = 200
# Ended runs whose end some tracker lacks that one ``Tracker.sync`` looks at.
ENDED_PER_SYNC = 50
# A run whose sync failed is tried again after this long, doubled per failure up to the cap.
RETRY_S, RETRY_CAP_S = 5.0, 300.0


def sync_run(
    run: RunRow,
    *,
    state: StateStore,
    sinks: Sequence[Sink],
    catalog: PriceCatalog,
    evals: Sequence[Point] = (),
    limit: int = BATCH_ITERATIONS,
) -> None:
    """Send ``run``'s iterations and ``evals`` beyond each sink's cursor, then advance the cursor;
    once the run has ended and every point is sent, send its end. ``TrackingError`` (after the
    other sinks had their turn) if a sink failed.

    ``evals``: the run's recorded held-out evaluations, as points at their policy version (see
    ``services.control.tracking.points.eval_point``), none newer than an evaluation still running: they
    are sent in version order, and a cursor that passed a version does not go back for it.
    """
    cursors = state.tracking_cursors(run.id)
    ended = RunStatus(run.status).is_terminal()
    todo = [(sink, cursors.get(sink.name)) for sink in sinks]
    todo = [(sink, c) for sink, c in todo if c is None or not c.ended]
    newest_eval = max((e.step for e in evals), default=-1)
    if not any(
        c is None or c.iteration < run.iterations_done or c.eval_version < newest_eval or ended for _, c in todo
    ):
        return  # nothing new for any sink: no read beyond the cursors
    start = min(c.iteration if c is not None else 0 for _, c in todo)
    rows = state.iterations(run.id, after=start, limit=limit)
    complete = len(rows) < limit  # every iteration after ``start`` is read
    entries = state.ledger(run.id) if rows else []
    points = _iteration_points(run, rows, state=state, entries=entries, catalog=catalog)
    failures = []
    for sink, cursor in todo:
        try:
            _sync_sink(run, sink, cursor, state=state, points=points, evals=evals, complete=complete, ended=ended)
        except TrackingError as e:
            failures.append(str(e))
    if failures:
        raise TrackingError(f"run {run.id}: " + "; ".join(failures))


def _iteration_points(
    run: RunRow,
    rows: Sequence[IterationRow],
    *,
    state: StateStore,
    entries: Sequence[LedgerEntry],
    catalog: PriceCatalog,
) -> list[Point]:
    """The points of iterations ``rows``, each with the run's bill then and its pods' memory since
    the iteration before (the first: since the run started)."""
    if not rows:
        return []
    first = rows[0].iteration
    before = state.iterations(run.id, after=first - 2, limit=1) if first > 1 else []
    start = before[0].ended_at if before else 0.0
    reports = state.pod_memory(run.id, since=start, until=rows[-1].ended_at)
    points = []
    for r in rows:
        mine = [m for m in reports if start < m.at <= r.ended_at]
        points.append(iteration_point(r, dollars_at(entries, catalog, r.ended_at), memory_figures(mine)))
        start = r.ended_at
    return points


def _sync_sink(
    run: RunRow,
    sink: Sink,
    cursor: TrackingCursorRow | None,
    *,
    state: StateStore,
    points: list[Point],
    evals: Sequence[Point],
    complete: bool,
    ended: bool,
) -> None:
    iteration = cursor.iteration if cursor is not None else 0
    version = cursor.eval_version if cursor is not None else -1
    mine = [p for p in points if p.step > iteration]
    through = mine[-1].step if mine else iteration
    # An evaluation waits for the iterations before it, so that no sink sees it ahead of them.
    new_evals = [e for e in evals if e.step > version and (complete or e.step <= through)]
    batch = sorted([*mine, *new_evals], key=lambda p: (p.step, p.is_eval()))
    version = max([version, *(e.step for e in new_evals)])
    if batch:
        sink.write(run.id, batch)
    if batch or cursor is None:  # a first cursor is stored even empty: it marks the run as tracked
        state.advance_tracking_cursor(run.id, sink.name, iteration=through, eval_version=version)
    if ended and complete:
        sink.end_run(run.id, run.status, run.ended_at if run.ended_at is not None else time.time())
        state.advance_tracking_cursor(run.id, sink.name, iteration=through, eval_version=version, ended=True)


def eval_points(state: StateStore, run_id: str) -> list[Point]:
    """The run's recorded held-out evals as points (``eval/mean_score``, ``eval/pass@k``), none at
    or beyond an eval still open: they are sent in version order (see ``sync_run``)."""
    horizon = min((e.policy_version for e in state.eval_progress(run_id).open), default=None)
    return [
        eval_point(
            r.policy_version,
            r.ended_at or 0.0,
            {"mean_score": r.mean_score or 0.0, **{k: v for k, v in (r.metrics or {}).items() if k != "mean"}},
        )
        for r in state.evals(run_id)
        if horizon is None or r.policy_version < horizon
    ]


def tracking_of(run: RunRow) -> Tracking | None:
    """The run spec's ``tracking`` section (validated when the run was submitted)."""
    section = (run.spec or {}).get("tracking")
    return None if section is None else Tracking.model_validate(section)


@dataclass
class _Trouble:
    failures: int = 0
    retry_at: float = 0.0  # monotonic
    logged: str = ""


class Tracker:
    """What the scheduler loop calls each tick, ``sync(active_runs)``: every run's new figures to
    the trackers its spec names, then the end of runs that ended. A tracker's trouble is no run's:
    it is logged (once per distinct message) and retried later, and the run goes on.

    ``evals(run_id)``: the run's recorded evaluations as points (see ``sync_run``); by default, ``eval_points``.
    """

    def __init__(
        self,
        *,
        state: StateStore,
        sinks: SinkSet,
        catalog: PriceCatalog,
        evals: Callable[[str], Sequence[Point]] | None = None,
    ) -> None:
        self._state = state
        self._sinks = sinks
        self._catalog = catalog
        self._evals = evals or (lambda run_id: eval_points(state, run_id))
        self._trouble: dict[str, _Trouble] = {}

    def sync(self, runs: Iterable[RunRow]) -> None:
        rows = {r.id: r for r in runs}
        for run_id in self._state.runs_with_tracking_to_end(ENDED_PER_SYNC):
            if run_id not in rows:
                rows[run_id] = self._state.get_run(run_id)
        now = time.monotonic()
        for run in rows.values():
            trouble = self._trouble.get(run.id)
            if trouble is not None and now < trouble.retry_at:
                continue
            try:
                tracking = tracking_of(run)
                if tracking is None:
                    continue
                sync_run(
                    run,
                    state=self._state,
                    sinks=self._sinks.for_run(tracking),
                    catalog=self._catalog,
                    evals=self._evals(run.id),
                )
            except Exception as e:  # noqa: BLE001 - a tracker's failure must not stop the runs' reconcile
                self._failed(run.id, e)
            else:
                if self._trouble.pop(run.id, None) is not None:
                    log.info("run %s: its figures reach the experiment trackers again", run.id)

    def _failed(self, run_id: str, error: Exception) -> None:
        trouble = self._trouble.setdefault(run_id, _Trouble())
        trouble.failures += 1
        trouble.retry_at = time.monotonic() + min(RETRY_CAP_S, RETRY_S * 2 ** (trouble.failures - 1))
        message = str(error) if isinstance(error, TrackingError) else f"{type(error).__name__}: {error}"
        if message != trouble.logged:
            log.warning(
                "run %s: sending figures to experiment trackers failed, retrying: %s",
                run_id,
                message,
                exc_info=not isinstance(error, TrackingError),
            )
            trouble.logged = message

    def close(self) -> None:
        self._sinks.close()
