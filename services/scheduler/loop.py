"""The reconcile loop: observe each run, ask ``plan`` what to do, apply it.

Everything it knows comes from the state store, the queue and the launcher on every tick, so
it can be stopped and restarted at any moment, and a standby scheduler can take over: only the
holder of the scheduler lease (``services.scheduler.lease``) reconciles.

Errors rise to ``tick`` (``services.errors``): a ``TemporaryError`` is retried after its delay,
doubling while it recurs, with its reason shown on the run; a ``PermanentError`` fails the run;
any other exception is unexpected: logged once and retried next tick.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from contracts.status import RunStatus
from services.backends.launcher import PodSpec, cli_command, pod_outcome
from services.backends.queue import next_offsets
from services.backends.state_schema import IterationRow, RunRow
from services.config import Settings
from services.cost.billing import billed_dollars
from services.cost.catalog import PriceCatalog
from services.cost.live_prices import load_prices
from services.errors import PermanentError, TemporaryError
from services.names import (
    ROLLOUT_GROUP,
    TRAINER_GROUP,
    leftover_key,
    pod_log_key,
    prompts_key,
    prompts_topic,
    result_key,
    rollout_pod_name,
    samples_topic,
    standby_pod_name,
    training_pod_name,
)
from contracts.job_result import JobResult
from contracts.messages import PromptMessage
from services.policy_rotation import rotate
from services.prompts import InvalidPromptsError, parse_jsonl
from services.runspec import CostPolicy, PromptItem, RunSpec
from services.scheduler import plan as p
from services.scheduler.lease import Leadership
from services.scheduler.policies import Estimates, measured
from services.training.backlog import trainer_consumer
from services.wiring import Backends
from contracts.samples import decode_group

log = logging.getLogger(__name__)

LOG_LINES_KEPT = 2000
# Ended runs whose topics one tick deletes: bounded, like the rest of a tick's work.
QUEUE_DELETIONS_PER_TICK = 10


def leftover_prefix(run_id: str) -> str:
    """Where the samples still queued when the run ended are listed, in chunks (``leftover_chunk_key``)."""
    return leftover_key(run_id).removesuffix(".json") + "/"


def leftover_chunk_key(run_id: str, start: int, count: int) -> str:
    """``count`` leftover sample ids, from the trainer group's committed offsets summing to ``start``."""
    return f"{leftover_prefix(run_id)}{start:012d}-{count}.json"

# A run that keeps raising TemporaryError waits its delay doubled per failure, at most this long.
TEMPORARY_RETRY_CAP_S = 120.0


def _log_decisions(run_id: str, actions: list[p.Action], observed: p.Observed) -> None:
    """Each pod started or stopped, at INFO, with the figures it was decided on: what an operator
    paying for the pods asks first."""
    decided = [a for a in actions if isinstance(a, p.LaunchWorker | p.LaunchTraining | p.LaunchStandby | p.StopPod)]
    if decided:
        log.info("run %s: %s (prompt backlog %d, sample backlog %d, trainer committed %d, pods %s)", run_id,
                 ", ".join(map(_describe, decided)), observed.prompt_backlog, observed.sample_backlog,
                 observed.trainer_committed, ", ".join(f"{pod.name}:{pod.phase}" for pod in observed.pods) or "none")


def _describe(action: p.Action) -> str:
    match action:
        case p.LaunchWorker(_, slot, on_demand):
            return f"launch rollout slot {slot}" + (" on-demand" if on_demand else "")
        case p.LaunchStandby(_, after):
            return f"hold the training node warm after iteration {after}"
        case p.LaunchTraining(_, iteration):
            return f"launch training job {iteration}"
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
        self.catalog = catalog or load_prices(settings)
        self.leadership = Leadership(backends.state, settings.lease_seconds)
        self._prompt_sets: dict[str, list[PromptItem]] = {}
        self._trouble: dict[str, _Trouble] = {}

    # --- the loop ---------------------------------------------------------------------
    def run_forever(self, stop: threading.Event) -> None:
        """Tick until ``stop``; then give the lease up, so that a standby takes over at once."""
        try:
            while not stop.is_set():
                self.tick()
                stop.wait(self.settings.tick_seconds)
        finally:
            self.leadership.release()

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
        for row in runs.values():
            if not self.leadership.leads():  # this tick outlasted the lease: a new leader may be acting
                return
            trouble = self._trouble.get(row.id)
            if trouble is not None and time.monotonic() < trouble.retry_at:
                continue
            try:
                self.reconcile(row, pods_by_run.get(row.id, []))
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
                log.warning("deleting the topics of ended run %s failed (%s: %s); retrying", run_id, type(e).__name__, e)
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
        self._trouble.pop(row.id, None)
        if row.last_error is not None:
            self.b.state.update_run(row.id, last_error=None)

    def reconcile(self, row: RunRow, pods: list) -> list[p.Action]:
        spec = RunSpec.from_stored(row.spec)
        state = p.RunState(
            run_id=row.id,
            status=RunStatus(row.status),
            spec=spec,
            iterations_done=row.iterations_done,
            last_mean_reward=row.last_mean_reward,
            prompts_published=row.prompts_published,
            ending_status=RunStatus(row.ending_status) if row.ending_status else None,
            ending_reason=row.ending_reason,
            train_failures=row.train_failures,
            next_train_at=row.next_train_at,
            worker_slots_used=row.worker_slots_used,
            samples_produced=row.samples_produced,
            train_launch_committed=row.train_launch_committed,
            started_at=row.started_at,
        )
        observed = self.observe(row, pods, spec.samples_per_prompt, measure=spec.cost_policy == CostPolicy.COST_AWARE)
        actions = p.plan(state, observed)
        _log_decisions(row.id, actions, observed)
        for action in actions:
            self.apply(action, spec)
        return actions

    def observe(self, row: RunRow, pods: list, group_size: int, measure: bool = True) -> p.Observed:
        """The run's world now; the sample topic's records are groups of ``group_size`` samples.
        ``measure``: with the estimates of its rollout rate and job time (two more queries a tick),
        which only the cost-aware policy reads."""
        now = time.time()
        started = row.started_at is not None  # its topics exist (a run cancelled while PENDING has none)
        samples = samples_topic(row.id)
        ledger = self.b.state.ledger(row.id)
        ended_jobs = [int(pod.labels["iteration"]) for pod in pods if pod.role == p.ROLE_TRAINING and pod.phase.is_terminal()]
        return p.Observed(
            pods=pods,
            prompt_backlog=self.b.queue.backlog(prompts_topic(row.id), ROLLOUT_GROUP) if started else 0,
            sample_backlog=group_size * self.b.queue.backlog(samples, TRAINER_GROUP) if started else 0,
            samples_produced=group_size * sum(self.b.queue.end_offsets(samples).values()) if started else 0,
            trainer_committed=sum(self.b.queue.committed(samples, TRAINER_GROUP).values()) if started else 0,
            spent_dollars=sum(billed_dollars(ledger, self.catalog, now)),  # the cost report's figure
            billed=frozenset(e.pod for e in ledger),
            open_entries={e.pod: e.started_at for e in ledger if e.ended_at is None},
            now=now,
            published=frozenset(i for i in ended_jobs if self.b.objects.exists(result_key(row.id, i))),
            estimates=measured([(w.samples_produced, w.generation_seconds) for w in self.b.state.worker_stats(row.id)],
                               [it.seconds for it in self.b.state.iterations(row.id)]) if measure else Estimates(None, None),
        )

    # --- applying actions ---------------------------------------------------------------
    def apply(self, action: p.Action, spec: RunSpec) -> None:
        log.debug("apply %s", action)
        match action:
            case p.StartRun(run_id):
                partitions = spec.rollout.max_workers
                self.b.queue.create_topic(prompts_topic(run_id), partitions)
                self.b.queue.create_topic(samples_topic(run_id), partitions)
                self.b.state.set_status(run_id, RunStatus.RUNNING)
            case p.PublishPrompts(run_id, start, count):
                self._publish_prompts(run_id, start, count)
            case p.LaunchWorker(run_id, slot, on_demand):
                self.b.state.update_run(run_id, worker_slots_used=slot + 1)
                name = rollout_pod_name(run_id, slot)
                command = cli_command(["worker", run_id, "--worker-id", name])
                self._launch(run_id, name, "rollout", command, spec.rollout.instance_type,
                             "spot" if spec.rollout.spot and not on_demand else "on-demand", {"slot": str(slot)})
            case p.LaunchTraining(run_id, iteration):
                committed = sum(self.b.queue.committed(samples_topic(run_id), TRAINER_GROUP).values())
                self.b.state.update_run(run_id, train_launch_committed=committed)
                name = training_pod_name(run_id, iteration)
                self._launch(run_id, name, "training",
                             cli_command(["train-job", run_id, str(iteration)], processes=spec.training.processes),
                             spec.training.instance_type, "on-demand", {"iteration": str(iteration)})
            case p.LaunchStandby(run_id, after):
                self._launch(run_id, standby_pod_name(run_id, after), p.ROLE_STANDBY,
                             [sys.executable, "-m", "services.scheduler.standby"],
                             spec.training.instance_type, "on-demand", {"after_iteration": str(after)})
            case p.StopPod(name):
                self.b.launcher.stop(name, grace_s=self.settings.stop_grace_s)
            case p.BillPod(pod):
                self._bill(pod.run_id, pod.name, pod.role, pod.instance_type, pod.capacity_type, pod.started_at)
            case p.CloseEntry(pod, ended_at, None):
                log.warning("pod %s has an open ledger entry but was never launched; closed with nothing billed", pod)
                self.b.state.close_ledger(pod, ended_at=ended_at)
            case p.CloseEntry(pod, ended_at, outcome):
                self.b.state.close_ledger(pod, ended_at=ended_at, outcome=outcome)
            case p.ReapPod(pod):
                self.b.state.close_ledger(pod.name, ended_at=pod.ended_at or time.time(), outcome=pod_outcome(pod))
                # Pods and their logs go away together; keep the log where `spotrl logs` finds it.
                log_text = self.b.launcher.logs(pod.name, tail=LOG_LINES_KEPT)
                self.b.objects.put_bytes(pod_log_key(pod.run_id, pod.name), log_text.encode())
                self.b.launcher.delete(pod.name)
            case p.RecordIteration(run_id, iteration):
                self._record_iteration(run_id, iteration)
            case p.RecordTrainingFailure(run_id, iteration, failures, retry_at):
                log.warning("run %s: training job %d failed (%d so far); retrying", run_id, iteration, failures)
                self.b.state.update_run(run_id, train_failures=failures, next_train_at=retry_at)
            case p.RecordProgress(run_id, produced):
                self.b.state.update_run(run_id, samples_produced=produced)
            case p.BeginEnding(run_id, status, reason):
                log.info("run %s ending: %s (%s)", run_id, status.value, reason)
                self.b.state.begin_ending(run_id, status, reason)
            case p.DropLeftovers(run_id, limit):
                self._drop_leftovers(run_id, limit)
            case p.FinishRun(run_id, status, reason):
                self._finish(run_id, status, reason)

    def _launch(self, run_id: str, name: str, role: str, command: list[str], instance_type: str,
                capacity_type: str, labels: dict[str, str]) -> None:
        """Open the pod's ledger entry, then start the pod: no pod ever runs unbilled.

        A launch that raises closes the entry at once, with nothing billed (should the pod have
        started after all, the next tick bills it from its start: ``BillPod``). A scheduler that
        dies between the two leaves an open entry without a pod, which the next tick closes the
        same way (``CloseEntry``).
        """
        started = time.time()
        self._bill(run_id, name, role, instance_type, capacity_type, started)
        try:
            self.b.launcher.launch(
                PodSpec(
                    name=name,
                    run_id=run_id,
                    role=role,
                    command=command,
                    env=self.settings.pod_env(),
                    instance_type=instance_type,
                    capacity_type=capacity_type,
                    labels=labels,
                )
            )
        except Exception:
            self.b.state.close_ledger(name, ended_at=started)
            raise

    def _bill(self, run_id: str, name: str, role: str, instance_type: str, capacity_type: str, started: float) -> None:
        price = self.catalog.get(instance_type)
        self.b.state.open_ledger(
            run_id=run_id,
            role=role,
            pod=name,
            instance_type=instance_type,
            capacity_type=capacity_type,
            price_per_hour=price.price(capacity_type),
            price_source=price.described(),
            started_at=started,
        )

    def _publish_prompts(self, run_id: str, start: int, count: int) -> None:
        if run_id not in self._prompt_sets:
            self._prompt_sets[run_id] = self._stored_prompts(run_id)
        items = self._prompt_sets[run_id]
        messages = []
        for i in range(start, start + count):
            item = items[i % len(items)]  # epochs cycle over the prompt set
            messages.append(PromptMessage(prompt_id=str(i % len(items)), prompt=item.prompt, answer=item.answer))
        self.b.queue.produce(prompts_topic(run_id), [m.encode() for m in messages])
        self.b.state.update_run(run_id, prompts_published=start + count)

    def _stored_prompts(self, run_id: str) -> list[PromptItem]:
        """The run's prompt set as the API stored it (``prompts.to_jsonl``), read by the API's own
        parser: lines end at "\n" only, so a prompt holding U+2028 or U+0085 stays whole. A set
        that does not parse never will: the run fails rather than being retried every tick."""
        try:
            return parse_jsonl(self.b.objects.get_bytes(prompts_key(run_id)), "the run's stored prompt set")
        except InvalidPromptsError as e:
            raise PermanentError(str(e)) from None

    def _record_iteration(self, run_id: str, iteration: int) -> None:
        key = result_key(run_id, iteration)
        if not self.b.objects.exists(key):
            raise PermanentError(f"training job {iteration} exited 0 without publishing {key}")
        r = JobResult.from_json(self.b.objects.get_bytes(key))
        self._commit_trained(run_id, iteration, r)
        self.b.state.record_iteration(
            IterationRow(
                run_id=run_id,
                iteration=iteration,
                policy_version=r.policy_version,
                mean_reward=r.mean_reward,
                kl=r.kl,
                loss=r.metrics.get("actor/loss", 0.0),
                seconds=r.seconds,
                samples_trained=len(r.trained_ids),
                samples_dropped=r.dropped.count(),
                metrics=r.metrics,
                ended_at=r.ended_at,
            )
        )
        log.info("run %s: iteration %d done, mean reward %.3f", run_id, iteration, r.mean_reward)
        rotate(self.b.objects, run_id, latest=self.b.state.policy_version(run_id), keep=self.settings.keep_policy_versions)

    def _commit_trained(self, run_id: str, iteration: int, result: JobResult) -> None:
        """Commit the samples a published iteration trained, if its job died before committing
        them (between writing its result and its commit): a later job must not train them again,
        nor the run's end count them as dropped. Only forward, so recording twice changes nothing."""
        topic = samples_topic(run_id)
        committed = self.b.queue.committed(topic, TRAINER_GROUP)
        ahead = {part: offset for part, offset in result.offsets.items() if offset > committed.get(part, 0)}
        if not ahead:
            return
        log.warning("run %s: training job %d published v%d and ended before committing its samples; committing them",
                    run_id, iteration, result.policy_version)
        # No job is running (the next one starts once this iteration is recorded): joining the
        # trainer group as its member fences no one.
        consumer = trainer_consumer(self.b.queue, run_id)
        try:
            consumer.commit(ahead)
        finally:
            consumer.close()

    def _drop_leftovers(self, run_id: str, limit: int) -> None:
        """Count the samples of up to ``limit`` of the groups still queued as dropped: their ids go to an object
        named by where they start (a retry after a crash rewrites the same one), then they are
        committed, then the run's count is recomputed from what is stored (``_count_dropped``)."""
        topic = samples_topic(run_id)
        start = sum(self.b.queue.committed(topic, TRAINER_GROUP).values())
        want = min(limit, sum(self.b.queue.end_offsets(topic).values()) - start)
        consumer = trainer_consumer(self.b.queue, run_id)
        try:
            records: list = []
            while len(records) < want:
                polled = consumer.poll(want - len(records), timeout_s=1.0)
                if not polled:  # never expected (this is the group's only member): the next tick goes on
                    break
                records += polled
            if records:
                ids = [sample.sample_id for r in records for sample in decode_group(r.value)]
                self.b.objects.put_bytes(leftover_chunk_key(run_id, start, len(ids)),
                                         json.dumps({"run_ended": ids}).encode())
                consumer.commit(next_offsets(records))
        finally:
            consumer.close()
        self._count_dropped(run_id)

    def _count_dropped(self, run_id: str) -> None:
        """Set the run's dropped count from what is stored: each iteration's, and the leftovers'
        chunks (their sizes are in their names). Setting, not adding: a retry counts nothing twice.
        Queued samples only: what dynamic sampling dropped before queueing is ``samples_filtered``,
        which rollout workers add to and this leaves alone."""
        iterations = sum(it.samples_dropped for it in self.b.state.iterations(run_id))
        leftovers = sum(int(key.rsplit("-", 1)[1].removesuffix(".json"))
                        for key in self.b.objects.list(leftover_prefix(run_id)))
        self.b.state.update_run(run_id, samples_dropped=iterations + leftovers)

    def _finish(self, run_id: str, status: RunStatus, reason: str) -> None:
        """End the run: all pods are gone and nothing is left queued (``_drop_leftovers``)."""
        self._count_dropped(run_id)
        self.b.state.set_status(run_id, status, reason)
        self._prompt_sets.pop(run_id, None)
        log.info("run %s %s: %s", run_id, status.value, reason)
