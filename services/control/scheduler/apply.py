"""Applying ``plan``'s actions: what each one does to the queue, the launcher, the object store
and the state store.

The reconcile loop (``services.control.scheduler.loop``) hands each action of a tick to ``Applier.apply``;
errors rise to the loop's ``tick``, which retries or fails the run.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from contracts.evaluation import EvalResult
from contracts.job_result import JobResult
from contracts.samples import decode_group
from contracts.status import RunStatus
from services.control.cost.billing import RolloutTerms
from services.control.scheduler import plan as p
from services.control.scheduler.evals import EvalAction
from services.control.scheduler.pool_options import OPTION_LABEL
from services.control.scheduler.spot_training import ANY_ZONE, spot_zones
from services.core.config import Settings
from services.core.errors import PermanentError
from services.domain.backlog import trainer_consumer
from services.domain.names import (
    ROLE_EVAL,
    ROLE_REWARD,
    ROLE_ROLLOUT,
    ROLE_STANDBY,
    ROLE_TRAINING,
    TRAINER_GROUP,
    eval_pod_name,
    eval_result_key,
    leftover_key,
    pod_log_key,
    prompts_key,
    prompts_topic,
    result_key,
    reward_server_pod_name,
    rollout_pod_name,
    samples_topic,
    standby_pod_name,
    training_pod_name,
)
from services.domain.policy_rotation import rotate
from services.domain.prompt_items import PromptItem, cycled_messages
from services.domain.prompts import InvalidPromptsError, parse_jsonl
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import (
    POD_CAPACITY_ENV,
    POD_NAME_ENV,
    POD_ROLE_ENV,
    PodSpec,
    cli_command,
    node_names,
    pod_outcome,
)
from services.ports.prices.catalog import PriceCatalog
from services.ports.queue.queue import next_offsets
from services.ports.state.state_schema import IterationRow
from services.ports.state.state_store import IllegalTransitionError
from services.ports.wiring import Backends

log = logging.getLogger(__name__)

# A reaped pod's log is kept to its last lines (``ReapPod``).
LOG_LINES_KEPT = 2000


def leftover_prefix(run_id: str) -> str:
    """Where the samples still queued when the run ended are listed, in chunks (``leftover_chunk_key``)."""
    return leftover_key(run_id).removesuffix(".json") + "/"


def leftover_chunk_key(run_id: str, start: int, count: int) -> str:
    """``count`` leftover sample ids, from the trainer group's committed offsets summing to ``start``."""
    return f"{leftover_prefix(run_id)}{start:012d}-{count}.json"


class Applier:
    """Does what ``plan``'s actions say, for the scheduler that holds it."""

    def __init__(self, backends: Backends, settings: Settings, catalog: PriceCatalog) -> None:
        self.b = backends
        self.settings = settings
        self.catalog = catalog
        self._prompt_sets: dict[str, list[PromptItem]] = {}

    def apply(self, action: p.Action, spec: RunSpec) -> None:
        log.debug("apply %s", action)
        match action:
            case p.StartRun(run_id):
                partitions = spec.rollout.max_workers
                self.b.queue.create_topic(prompts_topic(run_id), partitions)
                self.b.queue.create_topic(samples_topic(run_id), partitions)
                try:
                    self.b.state.set_status(run_id, RunStatus.RUNNING)
                except IllegalTransitionError:  # cancelled since this tick read it: the next tick ends it
                    log.info("run %s: cancelled before it started", run_id)
            case p.PublishPrompts(run_id, start, count):
                self._publish_prompts(run_id, start, count)
            case p.LaunchWorker(run_id, slot, on_demand, option):
                self.b.state.update_run(run_id, worker_slots_used=slot + 1)
                name = rollout_pod_name(run_id, slot)
                command = cli_command(["worker", run_id, "--worker-id", name])
                where = spec.rollout.choices[option]
                self._launch(
                    run_id,
                    name,
                    ROLE_ROLLOUT,
                    command,
                    where.instance_type,
                    "spot" if spec.rollout.spot and not on_demand else "on-demand",
                    {"slot": str(slot), OPTION_LABEL: str(option)},
                    spec,
                    zone=where.zone,
                )
            case p.LaunchTraining(run_id, iteration, spot, zone):
                committed = sum(self.b.queue.committed(samples_topic(run_id), TRAINER_GROUP).values())
                self.b.state.update_run(run_id, train_launch_committed=committed)
                self._launch_on_training_node(
                    run_id,
                    training_pod_name(run_id, iteration),
                    ROLE_TRAINING,
                    cli_command(
                        ["train-job", run_id, str(iteration)],
                        processes=spec.training.processes,
                        nodes=spec.training.nodes,
                    ),
                    spec,
                    {"iteration": str(iteration)},
                    spot,
                    zone,
                    nodes=spec.training.nodes,
                )
            case p.LaunchStandby(run_id, after, spot, zone):
                self._launch_on_training_node(
                    run_id,
                    standby_pod_name(run_id, after),
                    ROLE_STANDBY,
                    [sys.executable, "-m", "services.control.scheduler.standby"],
                    spec,
                    {"after_iteration": str(after)},
                    spot,
                    zone,
                    nodes=spec.training.nodes,  # the next job's nodes, all held warm
                )
            case p.RefuseSpotTraining(run_id, refusals):
                log.info("run %s: no spot training node came in time; zones given up: %s", run_id, sorted(refusals))
                self.b.state.update_run(run_id, spot_training_refusals=dict(refusals))
            case p.LaunchRewardServer(run_id):
                server = spec.reward_server
                assert server is not None  # planned for a spec that asks for one
                self._launch(
                    run_id,
                    reward_server_pod_name(run_id),
                    ROLE_REWARD,
                    cli_command(["reward-pod", run_id]),
                    server.instance_type,
                    "spot" if server.spot else "on-demand",
                    {},
                    spec,
                )
            case p.LaunchEval() | p.RecordEval() | p.RecordEvalFailure():
                self._apply_eval(action, spec)
            case p.StopPod(name):
                self.b.launcher.stop(name, grace_s=self.settings.stop_grace_s)
            case p.BillPod(pod) as bill:
                self._bill(pod.run_id, bill.entry, pod.role, pod.instance_type, pod.capacity_type, pod.started_at, spec)
            case p.DeferEntry(pod, started_at):
                self.b.state.defer_ledger(pod, started_at=started_at)
            case p.CloseEntry(pod, ended_at, None):
                log.warning("pod %s has an open ledger entry but was never launched; closed with nothing billed", pod)
                self.b.state.close_ledger(pod, ended_at=ended_at)
            case p.CloseEntry(pod, ended_at, outcome):
                self.b.state.close_ledger(pod, ended_at=ended_at, outcome=outcome)
            case p.ReapPod(pod):
                for entry in node_names(pod.name, pod.nodes):
                    self.b.state.close_ledger(entry, ended_at=pod.ended_at or time.time(), outcome=pod_outcome(pod))
                # Pods and their logs go away together; keep the log where `spotrl logs` finds it.
                log_text = self.b.launcher.logs(pod.name, tail=LOG_LINES_KEPT)
                self.b.objects.put_bytes(pod_log_key(pod.run_id, pod.name), log_text.encode())
                self.b.launcher.delete(pod.name)
            case p.RecordIteration(run_id, iteration):
                self._record_iteration(run_id, iteration, spec)
            case p.RecordTrainingFailure(run_id, iteration, failures, retry_at):
                log.warning("run %s: training job %d failed (%d so far); retrying", run_id, iteration, failures)
                self.b.state.update_run(run_id, train_failures=failures, next_train_at=retry_at)
            case p.RecordProgress(run_id, produced):
                self.b.state.update_run(run_id, samples_produced=produced)
            case p.RecordReason(run_id, reason):
                log.info("run %s: %s", run_id, reason or "no deadline purchase")
                self.b.state.update_run(run_id, status_reason=reason)
            case p.BeginEnding(run_id, status, reason):
                log.info("run %s ending: %s (%s)", run_id, status.value, reason)
                self.b.state.begin_ending(run_id, status, reason)
            case p.DropLeftovers(run_id, limit):
                self._drop_leftovers(run_id, limit)
            case p.FinishRun(run_id, status, reason):
                self._finish(run_id, status, reason)

    def _apply_eval(self, action: EvalAction, spec: RunSpec) -> None:
        """A held-out eval's actions (``services.control.scheduler.evals``)."""
        match action:
            case p.LaunchEval(run_id, version):
                self.b.state.open_eval(run_id, version, launched_at=time.time())  # first: a restarted scheduler sees it
                self._launch(
                    run_id,
                    eval_pod_name(run_id, version),
                    ROLE_EVAL,
                    cli_command(["eval-job", run_id, str(version)]),
                    spec.rollout.instance_type,
                    "spot" if spec.rollout.spot else "on-demand",
                    {"version": str(version)},
                    spec,
                )
            case p.RecordEval(run_id, version):
                result = EvalResult.from_json(self.b.objects.get_bytes(eval_result_key(run_id, version)))
                self.b.state.record_eval(run_id, result)
                log.info("run %s: eval of policy v%d done, mean score %.3f", run_id, version, result.mean_score)
            case p.RecordEvalFailure(run_id, version, failures, retry_at, gave_up):
                self.b.state.fail_eval(run_id, version, failures=failures, retry_at=retry_at, gave_up=gave_up)
                if gave_up is None:
                    log.warning("run %s: eval of policy v%d failed (%d so far); retrying", run_id, version, failures)
                else:  # the run goes on; its last_error says why this version has no eval
                    log.warning("run %s: %s", run_id, gave_up)
                    self.b.state.update_run(run_id, last_error=gave_up)

    def _launch_on_training_node(
        self,
        run_id: str,
        name: str,
        role: str,
        command: list[str],
        spec: RunSpec,
        labels: dict[str, str],
        spot: bool,
        zone: int,
        nodes: int = 1,
    ) -> None:
        """A training job (on ``nodes`` machines) or standby: on-demand in any zone, or spot in its
        spot zone (``spot_zones``)."""
        where = spot_zones(spec)[zone] if spot else ANY_ZONE
        self._launch(
            run_id,
            name,
            role,
            command,
            spec.training.instance_type,
            "spot" if spot else "on-demand",
            {**labels, OPTION_LABEL: str(zone)} if spot else labels,
            spec,
            zone=where or None,
            nodes=nodes,
        )

    def _launch(
        self,
        run_id: str,
        name: str,
        role: str,
        command: list[str],
        instance_type: str,
        capacity_type: str,
        labels: dict[str, str],
        spec: RunSpec,
        zone: str | None = None,
        nodes: int = 1,
    ) -> None:
        """Open the pod's ledger entries (one per node: ``node_names``), then start the pod: no pod
        ever runs unbilled. A rollout worker or eval pod uses ``rollout.gpus_per_worker`` of its
        node's GPUs and is billed that share of it (``RolloutTerms``); any other pod holds its nodes.

        A launch that raises closes the entry at once, with nothing billed (should the pod have
        started after all, the next tick bills it from its start: ``BillPod``). A scheduler that
        dies between the two leaves an open entry without a pod, which the next tick closes the
        same way (``CloseEntry``).
        """
        started = time.time()
        entries = node_names(name, nodes)
        for entry in entries:
            self._bill(run_id, entry, role, instance_type, capacity_type, started, spec)
        try:
            self.b.launcher.launch(
                PodSpec(
                    name=name,
                    run_id=run_id,
                    role=role,
                    command=command,
                    env={
                        **self.settings.pod_env(),
                        POD_NAME_ENV: name,
                        POD_ROLE_ENV: role,
                        POD_CAPACITY_ENV: capacity_type,
                    },
                    instance_type=instance_type,
                    capacity_type=capacity_type,
                    labels=labels,
                    zone=zone,
                    gpus=spec.rollout.gpus_per_worker if role in (ROLE_ROLLOUT, ROLE_EVAL) else None,
                    nodes=nodes,
                )
            )
        except Exception:
            for entry in entries:
                self.b.state.close_ledger(entry, ended_at=started)
            raise

    def _bill(
        self,
        run_id: str,
        name: str,
        role: str,
        instance_type: str,
        capacity_type: str,
        started: float,
        spec: RunSpec,
    ) -> None:
        price = self.catalog.get(instance_type)
        share = RolloutTerms(spec.rollout.gpus_per_worker).share(role, price)
        self.b.state.open_ledger(
            run_id=run_id,
            role=role,
            pod=name,
            instance_type=instance_type,
            capacity_type=capacity_type,
            price_per_hour=price.price(capacity_type) * share,
            price_source=price.described(),
            started_at=started,
        )

    def _publish_prompts(self, run_id: str, start: int, count: int) -> None:
        if run_id not in self._prompt_sets:
            self._prompt_sets[run_id] = self._stored_prompts(run_id)
        messages = cycled_messages(self._prompt_sets[run_id], start, count)
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

    def _record_iteration(self, run_id: str, iteration: int, spec: RunSpec) -> None:
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
        # Versions whose evals have not finished are kept for their eval pods.
        evaluating = (
            [e.policy_version for e in self.b.state.eval_progress(run_id).open] if spec.eval is not None else []
        )
        rotate(
            self.b.objects,
            run_id,
            latest=self.b.state.policy_version(run_id),
            in_use=evaluating,
            keep=self.settings.keep_policy_versions,
        )

    def _commit_trained(self, run_id: str, iteration: int, result: JobResult) -> None:
        """Commit the samples a published iteration trained, if its job died before committing
        them (between writing its result and its commit): a later job must not train them again,
        nor the run's end count them as dropped. Only forward, so recording twice changes nothing."""
        topic = samples_topic(run_id)
        committed = self.b.queue.committed(topic, TRAINER_GROUP)
        ahead = {part: offset for part, offset in result.offsets.items() if offset > committed.get(part, 0)}
        if not ahead:
            return
        log.warning(
            "run %s: training job %d published v%d and ended before committing its samples; committing them",
            run_id,
            iteration,
            result.policy_version,
        )
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
                self.b.objects.put_bytes(
                    leftover_chunk_key(run_id, start, len(ids)), json.dumps({"run_ended": ids}).encode()
                )
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
        leftovers = sum(
            int(key.rsplit("-", 1)[1].removesuffix(".json")) for key in self.b.objects.list(leftover_prefix(run_id))
        )
        self.b.state.update_run(run_id, samples_dropped=iterations + leftovers)

    def _finish(self, run_id: str, status: RunStatus, reason: str) -> None:
        """End the run: all pods are gone and nothing is left queued (``_drop_leftovers``)."""
        self._count_dropped(run_id)
        self.b.state.set_status(run_id, status, reason)
        self._prompt_sets.pop(run_id, None)
        log.info("run %s %s: %s", run_id, status.value, reason)
