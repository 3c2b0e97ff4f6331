"""The reconcile loop: observe each run, ask ``plan`` what to do, apply it (``services.control.scheduler.apply``).

Everything it knows comes from the state store, the queue and the launcher on every tick, so
it can be stopped and restarted at any moment, and a standby scheduler can take over: only the
holder of the scheduler lease (``services.control.scheduler.lease``) reconciles.

Errors rise to ``tick`` (``services.core.errors``): a ``TemporaryError`` is retried after its delay,
doubling while it recurs, with its reason shown on the run; a ``PermanentError`` fails the run;
any other exception is unexpected: logged once and retried next tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from contracts.status import RunStatus
from contracts.training import TrainingCapacity
from services.control.cost.report import spent_dollars
from services.control.scheduler import plan as p
from services.control.scheduler.apply import Applier
from services.control.scheduler.deadline import SpotProgress
from services.control.scheduler.lease import Leadership
from services.control.scheduler.policies import JOB_SECONDS_WINDOW, Estimates, measured
from services.control.scheduler.pool_options import worker_prices
from services.control.scheduler.run_state import EvalState, Observed, RunState, training_ended_at
from services.control.scheduler.spot_training import SpotTrainingRecord, TrainingPrices, spot_zones
from services.control.tracking.sinks import SinkSet
from services.control.tracking.sync import Tracker
from services.core.config import Settings
from services.core.errors import PermanentError, TemporaryError
from services.domain.backlog import SampleBacklog, sample_backlog
from services.domain.names import (
    ROLE_EVAL,
    ROLE_ROLLOUT,
    ROLE_TRAINING,
    ROLLOUT_GROUP,
    eval_result_key,
    prompts_topic,
    result_key,
    samples_topic,
)
from services.domain.runspec import CostPolicy, RunSpec
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_schema import RunRow
from services.ports.state.state_store import EvalProgress, ReconcileReads
from services.ports.wiring import Backends, open_prices

log = logging.getLogger(__name__)

# Ended runs whose topics one tick deletes: bounded, like the rest of a tick's work.
QUEUE_DELETIONS_PER_TICK = 10
# A run that keeps raising TemporaryError waits its delay doubled per failure, at most this long.
TEMPORARY_RETRY_CAP_S = 120.0
# Seconds between two sends of the runs' figures to their experiment trackers.
TRACKING_SECONDS = 5.0


def _decisions(actions: list[p.Action]) -> str:
    """The pods ``actions`` start or stop, in words ("" for none)."""
    pods = p.LaunchWorker | p.LaunchTraining | p.LaunchStandby | p.LaunchEval | p.LaunchRewardServer | p.StopPod
    decided = [a for a in actions if isinstance(a, pods)]
    return ", ".join(map(_describe, decided))


def _describe(action: p.Action) -> str:
    match action:
        case p.LaunchWorker(_, slot, on_demand):
            return f"launch rollout slot {slot}" + (" on-demand" if on_demand else "")
        case p.LaunchStandby(_, after):
            return f"hold the training node warm after iteration {after}"
        case p.LaunchTraining(_, iteration):
            return f"launch training job {iteration}"
        case p.LaunchEval(_, version):
            return f"launch the eval of policy v{version}"
        case p.LaunchRewardServer():
            return "launch the reward server"
        case p.StopPod(name):
            return f"stop {name}"
    return type(action).__name__


@dataclass
class _Trouble:
    """What went wrong with one run since it last reconciled cleanly (this process's memory only:
    a new leader starts afresh, which costs at most one early retry and one more log line)."""

    temporary_failures: int = 0
    retry_at: float = 0.0  # monotonic; the run is skipped until then
    logged: set[tuple[str, str]] = field(default_factory=set)  # unexpected (type, message) already logged


class Scheduler:
    def __init__(self, backends: Backends, settings: Settings, catalog: PriceCatalog | None = None) -> None:
        self.b = backends
        self.settings = settings
        self.catalog = catalog or open_prices(settings)
        self.leadership = Leadership(backends.state, settings.lease_seconds)
        self.applier = Applier(backends, settings, self.catalog)
        self._trouble: dict[str, _Trouble] = {}
        self._logged: dict[str, str] = {}  # run -> the decisions last logged for it (_log_decisions)
        self._standing: dict[str, str | None] = {}  # run -> the error a clean tick leaves on show (_recovered)
        # run -> its spot workers' progress, the deadline rule's recent window; a restarted scheduler
        # measures afresh (the rule keeps the on-demand workers held until the window holds a pace).
        self._spot_progress: dict[str, SpotProgress] = defaultdict(SpotProgress)

    # --- the loop ---------------------------------------------------------------------
    def run_forever(self, stop: threading.Event, heartbeat: Callable[[], None] = lambda: None) -> None:
        """Tick until ``stop``; then give the lease up, so that a standby takes over at once. The
        runs' figures go to their experiment trackers from a thread of their own: a slow tracker
        never holds a tick up. ``heartbeat`` is called after each tick (services.control.scheduler.health)."""
        tracking = threading.Thread(target=self._track_forever, args=(stop,), name="tracking", daemon=True)
        tracking.start()
        try:
            while not stop.is_set():
                self.tick()
                heartbeat()
                stop.wait(self.settings.tick_seconds)
        finally:
            tracking.join(timeout=TRACKING_SECONDS)
            self.leadership.release()

    def _track_forever(self, stop: threading.Event) -> None:
        """Send the runs' new figures to their trackers every TRACKING_SECONDS while this scheduler
        leads (the cursors in the state store say what each tracker has: nothing is sent twice)."""
        tracker = Tracker(state=self.b.state, sinks=SinkSet(self.settings, self.b.objects), catalog=self.catalog)
        try:
            while not stop.wait(TRACKING_SECONDS):
                if self.leadership.leads():
                    tracker.sync(self.b.state.list_runs(active_only=True))
        finally:
            tracker.close()

    def tick(self) -> None:
        """Reconcile each active run once, if this scheduler leads. A run's error stays with that run."""
        if not self.leadership.hold():
            return
        pods_by_run = defaultdict(list)
        for pod in self.b.launcher.list():
            pods_by_run[pod.run_id].append(pod)
        runs = {r.id: r for r in self.b.state.list_runs(active_only=True)}
        for run_id in pods_by_run.keys() - runs.keys():  # terminal runs whose pods outlived them
            runs[run_id] = self.b.state.get_run(run_id)
        self._trouble = {run_id: t for run_id, t in self._trouble.items() if run_id in runs}
        for run_id in self._spot_progress.keys() - runs.keys():
            del self._spot_progress[run_id]
        reads = self.b.state.reconcile_reads(list(runs), JOB_SECONDS_WINDOW)
        for row in runs.values():
            if not self.leadership.leads():  # this tick outlasted the lease: a new leader may be acting
                return
            trouble = self._trouble.get(row.id)
            if trouble is not None and time.monotonic() < trouble.retry_at:
                continue
            try:
                self.reconcile(row, pods_by_run.get(row.id, []), reads[row.id])
            except TemporaryError as e:
                self._retry_later(row, e)
            except PermanentError as e:
                log.error("run %s failed: %s", row.id, e)
                self.b.state.begin_ending(row.id, RunStatus.FAILED, str(e))
            except Exception as e:  # unexpected: the next tick retries from fresh state
                self._unexpected(row, e)
            else:
                self._recovered(row)
        self._delete_expired_queues()

    def _delete_expired_queues(self) -> None:
        """Delete the topics of runs that ended more than the queue retention ago, a few per tick.
        A failure is retried on a later tick: the run stays marked as still having them."""
        ended_before = time.time() - self.settings.queue_retention_s
        for run_id in self.b.state.runs_with_expired_queues(ended_before, limit=QUEUE_DELETIONS_PER_TICK):
            try:
                for topic in (prompts_topic(run_id), samples_topic(run_id)):
                    self.b.queue.delete_topic(topic)
            except Exception as e:  # the queue's trouble is no run's: log it and try again later
                log.warning(
                    "deleting the topics of ended run %s failed (%s: %s); retrying", run_id, type(e).__name__, e
                )
                return
            self.b.state.update_run(run_id, queues_deleted=True)

    def _retry_later(self, row: RunRow, error: TemporaryError) -> None:
        trouble = self._trouble.setdefault(row.id, _Trouble())
        trouble.temporary_failures += 1
        delay = min(TEMPORARY_RETRY_CAP_S, error.delay * 2 ** (trouble.temporary_failures - 1))
        trouble.retry_at = time.monotonic() + delay
        log.warning("run %s: %s; retrying in %.1f s", row.id, error.reason, delay)
        self._show_error(row, error.reason)

    def _unexpected(self, row: RunRow, error: Exception) -> None:
        """Log an unexpected error with its traceback once, not every tick while it recurs."""
        key = (type(error).__name__, str(error))
        trouble = self._trouble.setdefault(row.id, _Trouble())
        if key not in trouble.logged:
            trouble.logged.add(key)
            log.exception("reconciling run %s failed; retrying every tick (logged once)", row.id)
        self._show_error(row, f"{type(error).__name__}: {error}")

    def _show_error(self, row: RunRow, error: str) -> None:
        error = error[:500]  # the column's width
        if row.last_error != error:
            self.b.state.update_run(row.id, last_error=error)

    def _recovered(self, row: RunRow) -> None:
        """A clean tick clears the error shown, but for an eval given up: that reason stays."""
        self._trouble.pop(row.id, None)
        standing = self._standing.pop(row.id, None)
        if row.last_error != standing:
            self.b.state.update_run(row.id, last_error=standing)

    def reconcile(self, row: RunRow, pods: list, reads: ReconcileReads) -> list[p.Action]:
        """Plan and apply the run's actions; ``reads``: its rows as the tick read them for all runs."""
        spec = RunSpec.from_stored(row.spec)
        state = RunState.of(row, spec, **self._eval_state(row, spec))
        measure = spec.cost_policy == CostPolicy.COST_AWARE or spec.training.capacity == TrainingCapacity.AUTO
        observed = self.observe(row, pods, spec, measure=measure, reads=reads)
        actions = p.plan(state, observed)
        self._log_decisions(row.id, actions, observed)
        for action in actions:
            self.applier.apply(action, spec)
            if isinstance(action, p.RecordEvalFailure) and action.gave_up is not None:
                self._standing[row.id] = action.gave_up  # what this tick's clean end leaves on show
        return actions

    def _eval_state(self, row: RunRow, spec: RunSpec) -> dict:
        """The RunState fields of the run's held-out evals (one read, for runs that have them); the
        reason of the latest eval given up is noted to stay on the run's last_error."""
        if spec.eval is None:
            return {}
        progress: EvalProgress = self.b.state.eval_progress(row.id)
        self._standing[row.id] = progress.given_up.error if progress.given_up is not None else None
        best = progress.best  # recorded: it has a mean score
        return dict(
            eval_launched_through=progress.launched_through,
            evals_open={e.policy_version: EvalState(e.failures, e.retry_at) for e in progress.open},
            best_eval=None if best is None else (best.policy_version, best.mean_score),
        )

    def _log_decisions(self, run_id: str, actions: list[p.Action], observed: Observed) -> None:
        """Each pod started or stopped, at INFO, with the figures it was decided on: what an operator
        paying for the pods asks first. The same decisions tick after tick (a stop the plan repeats
        until the pod has ended) are logged once."""
        decided = _decisions(actions)
        if decided == self._logged.get(run_id, ""):
            return
        if not decided:
            self._logged.pop(run_id, None)
            return
        self._logged[run_id] = decided
        log.info(
            "run %s: %s (prompt backlog %d, sample backlog %d, trainer committed %d, pods %s)",
            run_id,
            decided,
            observed.prompt_backlog,
            observed.sample_backlog,
            observed.trainer_committed,
            ", ".join(f"{pod.name}:{pod.phase}" for pod in observed.pods) or "none",
        )

    def observe(
        self, row: RunRow, pods: list, spec: RunSpec, measure: bool = True, reads: ReconcileReads | None = None
    ) -> Observed:
        """The run's world now, for its spec ``spec``, from ``reads`` (read for the run alone if
        None). ``measure``: with the estimates of its rollout rate and job time, which the
        cost-aware policy and ``training.capacity: auto`` read."""
        if reads is None:
            reads = self.b.state.reconcile_reads([row.id], JOB_SECONDS_WINDOW)[row.id]
        group_size = spec.samples_per_prompt
        now = time.time()
        started = row.started_at is not None  # its topics exist (a run cancelled while PENDING has none)
        ledger = reads.ledger
        price = self.catalog.get(spec.training.instance_type)
        ended_jobs = [
            int(pod.labels["iteration"]) for pod in pods if pod.role == ROLE_TRAINING and pod.phase.is_terminal()
        ]
        ended_evals = [int(pod.labels["version"]) for pod in pods if pod.role == ROLE_EVAL and pod.phase.is_terminal()]
        backlog = sample_backlog(self.b.queue, row.id, group_size) if started else SampleBacklog(0, 0, 0)
        stats = reads.worker_stats if measure else []
        return Observed(
            pods=pods,
            prompt_backlog=self.b.queue.backlog(prompts_topic(row.id), ROLLOUT_GROUP) if started else 0,
            sample_backlog=backlog.queued,
            samples_produced=backlog.produced,
            trainer_committed=backlog.committed,
            spent_dollars=spent_dollars(ledger, self.catalog, now),  # the cost report's total
            billed=frozenset(e.pod for e in ledger),
            open_entries={e.pod: e.started_at for e in ledger if e.ended_at is None},
            now=now,
            published=frozenset(i for i in ended_jobs if self.b.objects.exists(result_key(row.id, i))),
            evals_published=frozenset(v for v in ended_evals if self.b.objects.exists(eval_result_key(row.id, v))),
            estimates=measured(
                [(w.samples_produced, w.generation_seconds) for w in stats],
                reads.job_seconds,
            )
            if measure
            else Estimates(None, None),
            spot_progress=self._spot_pace_points(row.id, now, stats, ledger) if measure else (),
            # The catalog prices a type alike in every zone.
            training_prices=TrainingPrices(spot=(price.spot,) * len(spot_zones(spec)), on_demand=price.on_demand),
            option_prices=worker_prices(spec, self.catalog),
            spot_training=SpotTrainingRecord.of(ledger, now),
            training_ended_at=training_ended_at(ledger),
        )

    def _spot_pace_points(self, run_id: str, now: float, stats: list, ledger: list) -> tuple[tuple[float, int], ...]:
        """The run's (time, samples made by its spot workers) points over the deadline rule's window, now's added."""
        spot = {e.pod for e in ledger if e.role == ROLE_ROLLOUT and e.capacity_type == "spot"}
        return self._spot_progress[run_id].record(now, sum(w.samples_produced for w in stats if w.worker in spot))
