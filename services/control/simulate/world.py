"""A discrete-event simulation of one run that drives the real scheduler's ``plan``.

Every tick the simulated world (clock, launcher, queue, ledger) is shown to
``services.control.scheduler.plan.plan`` as the real loop shows the real one, and its actions are
applied here: a policy decision is therefore tested once and used in both.

The world: spot rollout workers that start ``startup_seconds`` after launch, then turn prompts
into groups of samples at ``worker_samples_per_hour``. As on Kubernetes, a spot worker launched
while the trace has no capacity left waits for a node (``PodStatus.waiting_for_node``), oldest
first, and takes one when capacity returns: its node joins ``NODE_BOOT_SECONDS`` (or its start-up,
if shorter) after the capacity came, and its start-up counts from then. When the trace's capacity
drops below the workers on a node, the newest are preempted after the provider's notice (their
group in progress is lost). Training jobs start
after the start-up (at once on a warm node of their capacity: a standby's, or the one a training or standby pod
left less than ``HANDOVER_SECONDS`` ago, which the cluster has not scaled down yet), run ``training_minutes`` and train one batch,
dropping the samples older than the staleness bound.

A training job (or standby) takes ``training.nodes`` nodes, each with its ledger entry (as the
real ledger's ``node_names``), started and ended together; on spot it takes them of its spot
zone's training trace
(``training_traces``, one per zone of ``spot_zones``; none: no spot training node ever comes) as a
spot worker takes one of the rollout trace (waiting until that many are free), and is preempted
when that trace's capacity drops below the nodes of the zone's spot training pods on a node. A preempted job
checkpoints at the provider's notice and ends at once (with no notice, ``spot_notice_seconds`` 0,
it keeps only its last periodic checkpoint, every ``training.checkpoint_every_s`` of update);
the next job of its iteration resumes from there: a start-up (model load and the batch's
re-scoring) and the update's remaining seconds.

Each pod is billed from launch to its end
(a waiting pod's bill starts later, as the real ledger's ``DeferEntry`` moves it),
at the catalog's price of its capacity, except spot pods on a trace that carries
prices: those pay each tick's seconds at the trace's price for that tick (taken to be in the
catalog's currency of their instance type). The bill is ``services.control.cost.report``'s, in the
run's currency (the catalog's for its instance types; ``SimResult.currency``).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from contracts.status import RunStatus
from contracts.training import TrainingCapacity
from services.control.cost.billing import NODE_BOOT_SECONDS, RolloutTerms, billed_dollars
from services.control.cost.lower_bound import Busy, TrainingTerms, lower_bound_dollars
from services.control.cost.report import cost_report
from services.control.scheduler import plan as p
from services.control.scheduler.deadline import SpotProgress
from services.control.scheduler.policies import measured
from services.control.scheduler.pool_options import OPTION_LABEL
from services.control.scheduler.run_state import Observed, RunState, training_ended_at
from services.control.scheduler.spot_training import SpotTrainingRecord, TrainingPrices, spot_zones
from services.control.simulate.gap import PodSpan, gap
from services.control.simulate.traces import SpotTrace
from services.control.simulate.workload import Workload
from services.domain.names import ROLE_ROLLOUT, ROLE_STANDBY, ROLE_TRAINING
from services.domain.runspec import CostPolicy, RunSpec
from services.ports.launcher.launcher import PodPhase, PodStatus, node_names, pod_outcome
from services.ports.prices.catalog import InstancePrice, PriceCatalog, load_catalog
from services.ports.state.state_store import LedgerEntry

RUN_ID = "sim"
# A training node whose pod ended this long ago is still up (Kubernetes' cluster autoscaler waits
# 10 minutes by default before removing an empty node; this is far less, and unbilled).
HANDOVER_SECONDS = 30.0


def training_pool(zone: int) -> int:
    """The pool of the spot training nodes of a zone (its index in ``spot_zones``): -1, -2, ...,
    beside the rollout options 0, 1, ..."""
    return -1 - zone


@dataclass(frozen=True)
class SimResult:
    """A run's figures; ``dollars`` and the other money figures are in ``currency``."""

    policy: str
    currency: str  # the run's instance types' currency in the catalog, e.g. USD or CNY
    dollars: float
    wall_seconds: float
    lower_bound_dollars: float
    always_on_dollars: float
    samples_trained: int
    samples_dropped_stale: int
    preemptions: int  # of every spot pod: rollout workers, training jobs and standbys
    training_busy_fraction: float
    deadline_met: bool | None
    training_preemptions: int = 0  # of them, training jobs'
    finished: bool = True  # False: still running at the horizon (not in the JSON)
    gap: dict[str, float] = field(
        default_factory=dict
    )  # dollars above the bound, by part (services.control.simulate.gap)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("finished", "gap")}


@dataclass
class _Pod:
    status: PodStatus
    ready_at: float  # start-up done (math.inf while a spot worker waits for a node)
    done_at: float | None = None  # a training job's end
    preempt_at: float | None = None
    work_from: float = 0.0  # a training job's update seconds checkpointed before it started (a resume)
    entry_ids: list[int] = field(
        default_factory=list
    )  # its ledger entries', one per node (a relaunched job's name has some per attempt)
    holding: int | None = None  # a worker's prompt in hand: the policy version it started with
    progress: float = 0.0  # samples of its group done
    generated: int = 0
    generation_seconds: float = 0.0


@dataclass
class _World:
    spec: RunSpec
    workload: Workload
    traces: tuple[SpotTrace, ...]  # spot rollout nodes, one trace per option of the pool (``RolloutPool.choices``)
    catalog: PriceCatalog
    training_traces: tuple[SpotTrace, ...] = ()  # spot training nodes, one trace per spot zone; none: none ever
    pod_pools: dict[str, int] = field(default_factory=dict)  # pod -> its rollout option, or its training_pool
    now: float = 0.0
    run: RunState | None = None
    pods: dict[str, _Pod] = field(default_factory=dict)
    prompts_pending: int = 0  # published, not yet turned into samples
    groups: deque = field(default_factory=deque)  # (policy version, samples) queued for the trainer
    produced: int = 0
    trainer_committed: int = 0
    ledger: dict[str, LedgerEntry] = field(default_factory=dict)  # each pod name's latest entry
    past_entries: list[LedgerEntry] = field(default_factory=list)  # earlier entries of names launched again
    priced_by: dict[int, SpotTrace] = field(default_factory=dict)  # entry id -> the trace whose prices bill it
    job_seconds: list[float] = field(default_factory=list)
    trained: int = 0
    stale: int = 0
    preemptions: int = 0
    training_preemptions: int = 0
    # When the last training or standby pod ended, by its capacity type and pool: its node is still up a while.
    node_released_at: dict[tuple[str, int], float] = field(default_factory=dict)
    checkpointed: dict[int, float] = field(default_factory=dict)  # iteration -> update seconds saved
    _all_pods: list[_Pod] = field(default_factory=list)  # every pod ever started: the estimates, the gap
    spot_progress: SpotProgress = field(default_factory=SpotProgress)  # the deadline rule's pace window

    def _all_workers(self) -> list[_Pod]:
        return [pod for pod in self._all_pods if pod.status.role == ROLE_ROLLOUT]

    # --- the world moving on ----------------------------------------------------------
    def advance(self, dt: float) -> None:
        end = self.now + dt
        for pool in (*range(len(self.traces)), *map(training_pool, range(len(self.training_traces)))):
            self._place_waiting(pool)
            self._preempt_beyond_capacity(pool)
        for pod in list(self.pods.values()):
            if pod.status.phase != PodPhase.RUNNING:
                continue
            if pod.status.role == ROLE_ROLLOUT:
                stop = min(end, pod.preempt_at if pod.preempt_at is not None else end)
                self._generate(pod, max(self.now, pod.ready_at), stop)
                if pod.preempt_at is not None and pod.preempt_at <= end:
                    self.preemptions += 1
                    self._end(pod, pod.preempt_at, PodPhase.FAILED, -15, preempted=True)
            elif pod.preempt_at is not None:  # a spot training or standby pod, told at its notice
                self.preemptions += 1
                self.training_preemptions += pod.status.role == ROLE_TRAINING
                self._end(pod, pod.preempt_at, PodPhase.FAILED, -15, preempted=True)
            elif pod.status.role == ROLE_TRAINING and pod.done_at is not None and pod.done_at <= end:
                self._end(pod, pod.done_at, PodPhase.SUCCEEDED, 0)
        self.now = end

    def _trace_of(self, pool: int) -> SpotTrace | None:
        """The trace of a pool: a rollout option's (its index), or a spot zone's training nodes' (``training_pool``)."""
        if pool >= 0:
            return self.traces[pool]
        zone = training_pool(pool)  # its own inverse
        return self.training_traces[zone] if zone < len(self.training_traces) else None

    def _capacity(self, pool: int) -> int:
        """Spot nodes the pool's trace has now."""
        trace = self._trace_of(pool)
        return 0 if trace is None else trace.at(self.now)

    def _place_waiting(self, pool: int) -> None:
        """Spot pods waiting for a node take their trace's free capacity (all their nodes), oldest first."""
        free = self._capacity(pool) - self._nodes_held(pool)
        for pod in sorted(self._spot_pods(pool, waiting=True), key=lambda w: w.status.started_at):
            if pod.status.nodes > free:
                break
            free -= pod.status.nodes
            joined = self.now + min(NODE_BOOT_SECONDS, self.workload.startup_seconds)
            pod.status = replace(pod.status, waiting_for_node=False, node_joined_at=joined)
            pod.ready_at = self.now + self.workload.startup_seconds
            if pod.status.role == ROLE_TRAINING:
                pod.done_at = pod.ready_at + self._update_left(pod)

    def _preempt_beyond_capacity(self, pool: int) -> None:
        """The newest spot pods on a node beyond their trace's capacity get the provider's notice: a
        worker goes at its end, a training job checkpoints and goes at once (a standby with it)."""
        held = [w for w in self._spot_pods(pool) if w.preempt_at is None]
        excess = sum(w.status.nodes for w in held) - self._capacity(pool)
        for pod in sorted(held, key=lambda w: w.status.started_at, reverse=True):
            if excess <= 0:
                break
            excess -= pod.status.nodes  # a job of several loses all of them with any one
            pod.preempt_at = self.now + (0.0 if pool < 0 else self.workload.spot_notice_seconds)
            if pod.status.role == ROLE_TRAINING:
                self._checkpoint(pod)

    def _spot_pods(self, pool: int, waiting: bool = False) -> list[_Pod]:
        """The pool's running spot pods on a node (``waiting``: those waiting for one)."""
        return [
            w
            for w in self.pods.values()
            if self._pool_of(w.status.name) == pool
            and w.status.capacity_type == "spot"
            and w.status.phase == PodPhase.RUNNING
            and w.status.waiting_for_node == waiting
        ]

    def _nodes_held(self, pool: int) -> int:
        """The nodes the pool's running spot pods hold."""
        return sum(w.status.nodes for w in self._spot_pods(pool))

    def _update_left(self, job: _Pod) -> float:
        return self.workload.training_minutes * 60.0 - job.work_from

    def _checkpoint(self, job: _Pod) -> None:
        """What a preempted job saves of its update: all of it at the notice; with no notice, its
        last periodic checkpoint."""
        done = max(0.0, self.now - job.ready_at)
        if self.workload.spot_notice_seconds <= 0:
            every = self.spec.training.checkpoint_every_s
            done = math.floor(done / every) * every
        iteration = int(job.status.labels["iteration"])
        self.checkpointed[iteration] = job.work_from + done

    def _generate(self, pod: _Pod, t: float, end: float) -> None:
        n = self.spec.samples_per_prompt
        rate = self.workload.worker_samples_per_hour / 3600.0
        while t < end:
            if pod.holding is None:
                if self.prompts_pending - self._held() <= 0:
                    return
                pod.holding = self.run.iterations_done
            step = min((n - pod.progress) / rate, end - t)
            pod.progress += step * rate
            pod.generation_seconds += step
            t += step
            if pod.progress >= n - 1e-9:
                self.groups.append((pod.holding, n))
                self.produced += n
                pod.generated += n
                self.prompts_pending -= 1
                pod.holding, pod.progress = None, 0.0

    def _held(self) -> int:
        return sum(1 for w in self.pods.values() if w.holding is not None)

    def _end(self, pod: _Pod, at: float, phase: PodPhase, exit_code: int, preempted: bool = False) -> None:
        if pod.status.role != ROLE_ROLLOUT and not pod.status.waiting_for_node and not preempted:
            node = pod.status.capacity_type, self._pool_of(pod.status.name)
            self.node_released_at[node] = max(self.node_released_at.get(node, -math.inf), at)
        pod.status = replace(pod.status, phase=phase, exit_code=exit_code, ended_at=at, preempted=preempted)
        pod.holding, pod.progress = None, 0.0  # a prompt in hand goes back to the queue

    # --- what plan sees -------------------------------------------------------------------
    def observed(self) -> Observed:
        spot_made = sum(w.generated for w in self._all_workers() if w.status.capacity_type == "spot")
        entries = [*self.past_entries, *self.ledger.values()]
        return Observed(
            pods=[pod.status for pod in self.pods.values()],
            prompt_backlog=self.prompts_pending,
            sample_backlog=sum(s for _, s in self.groups),
            samples_produced=self.produced,
            spent_dollars=sum(
                billed_dollars(self.billed_ledger(self.now), self.catalog, self.now)
            ),  # as the real loop counts it
            billed=frozenset(self.ledger),
            open_entries={e.pod: e.started_at for e in self.ledger.values() if e.ended_at is None},
            now=self.now,
            trainer_committed=self.trainer_committed,
            published=frozenset(
                int(pod.status.labels["iteration"])
                for pod in self.pods.values()
                if pod.status.role == ROLE_TRAINING and pod.status.phase == PodPhase.SUCCEEDED
            ),
            estimates=measured(
                [(w.generated, w.generation_seconds) for w in self._all_workers()],
                self.job_seconds,
                self.workload.startup_seconds,
            ),
            spot_progress=self.spot_progress.record(self.now, spot_made),
            training_prices=TrainingPrices(
                spot=self._training_spot_prices(), on_demand=self._training_price().on_demand
            ),
            spot_training=SpotTrainingRecord.of(entries, self.now),
            training_ended_at=training_ended_at(entries),
            option_prices=self._option_prices(),
        )

    def _training_price(self) -> InstancePrice:
        return self.catalog.get(self.spec.training.instance_type)

    def _training_spot_prices(self) -> tuple[float, ...]:
        """The training instance type's spot price now in each spot zone: its trace's, where it carries prices."""
        return tuple(
            trace.price_at(self.now) if trace is not None and trace.prices is not None else self._training_price().spot
            for trace in map(self._trace_of, map(training_pool, range(len(spot_zones(self.spec)))))
        )

    def _pool_of(self, pod: str) -> int:
        return self.pod_pools[pod]

    def _option_prices(self) -> tuple[float, ...]:
        """Each rollout option's spot price of a worker now: its share of its trace's node price, where
        the trace carries prices, else of the catalog's."""
        return tuple(
            self._share(ROLE_ROLLOUT, option.instance_type)
            * (trace.price_at(self.now) if trace.prices is not None else self.catalog.get(option.instance_type).spot)
            for option, trace in zip(self.spec.rollout.choices, self.traces, strict=True)
        )

    def _share(self, role: str, instance_type: str) -> float:
        """The share of its node a pod of ``role`` is billed (a rollout worker's GPUs of the node's: ``RolloutTerms``)."""
        return RolloutTerms(self.spec.rollout.gpus_per_worker).share(role, self.catalog.get(instance_type))

    def billed_ledger(self, now: float) -> list[LedgerEntry]:
        """The ledger as billed up to ``now``: a spot pod on a priced trace at the mean of the
        trace's prices over its life (each tick's seconds at that tick's price; the provider's
        minimum, if it ran less, at that mean too); every other entry at the price it was opened with."""
        billed = []
        for e in [*self.past_entries, *self.ledger.values()]:
            seconds = e.seconds(now)
            trace = self.priced_by.get(e.id)
            if trace is not None and seconds > 0:
                node_per_hour = trace.spot_cost(e.started_at, e.started_at + seconds) * 3600.0 / seconds
                e = replace(e, price_per_hour=node_per_hour * self._share(e.role, e.instance_type))
            billed.append(e)
        return billed

    # --- applying plan's actions -------------------------------------------------------------
    def apply(self, action: p.Action) -> None:
        run = self.run
        match action:
            case p.StartRun():
                self.run = replace(run, status=RunStatus.RUNNING, started_at=self.now)
            case p.PublishPrompts(_, start, count):
                self.prompts_pending += count
                self.run = replace(run, prompts_published=start + count)
            case p.LaunchWorker(_, slot, on_demand, option):
                self.run = replace(run, worker_slots_used=slot + 1)
                spot = self.spec.rollout.spot and not on_demand
                no_capacity = spot and len(self._spot_pods(option)) >= self._capacity(option)
                pod = self._launch(
                    f"{RUN_ID}-rollout-{slot}",
                    ROLE_ROLLOUT,
                    self.spec.rollout.choices[option].instance_type,
                    "spot" if spot else "on-demand",
                    {"slot": str(slot), OPTION_LABEL: str(option)},
                    pool=option,
                )
                if no_capacity:  # it waits for a node (_place_waiting_workers)
                    pod.status, pod.ready_at = replace(pod.status, waiting_for_node=True), math.inf
            case p.LaunchStandby(_, after, spot, zone):
                self._launch_on_training_node(
                    f"{RUN_ID}-warm-{after}", ROLE_STANDBY, spot, zone, {"after_iteration": str(after)}
                )
            case p.LaunchTraining(_, iteration, spot, zone):
                self.run = replace(run, train_launch_committed=self.trainer_committed)
                pod = self._launch_on_training_node(
                    f"{RUN_ID}-train-{iteration}", ROLE_TRAINING, spot, zone, {"iteration": str(iteration)}
                )
                pod.work_from = self.checkpointed.get(iteration, 0.0)
                pod.done_at = pod.ready_at + self._update_left(pod)
            case p.RefuseSpotTraining(_, refusals):
                self.run = replace(run, spot_training_refusals=refusals)
            case p.StopPod(name):
                pod = self.pods[name]
                if pod.status.phase == PodPhase.RUNNING:
                    self._end(
                        pod,
                        self.now,
                        PodPhase.SUCCEEDED if pod.status.role != ROLE_TRAINING else PodPhase.FAILED,
                        0 if pod.status.role != ROLE_TRAINING else -15,
                    )
            case p.DeferEntry(name, started_at):  # a worker waited for a node
                self.ledger[name] = replace(self.ledger[name], started_at=started_at)
            case p.CloseEntry(name, ended_at, outcome) if outcome is not None:  # an ended pod, reaped this same tick
                self.ledger[name] = replace(self.ledger[name], ended_at=ended_at, outcome=outcome.value)
            case p.ReapPod(status):
                for name in node_names(status.name, status.nodes):
                    self.ledger[name] = replace(
                        self.ledger[name], ended_at=status.ended_at, outcome=pod_outcome(status).value
                    )
                del self.pods[status.name]
            case p.RecordIteration(_, iteration):
                self._train_batch()
                self.job_seconds.append(self.workload.training_minutes * 60.0)
                self.run = replace(run, iterations_done=iteration)
            case p.RecordProgress(_, produced):
                self.run = replace(run, samples_produced=produced)
            case p.RecordReason(_, reason):
                self.run = replace(run, status_reason=reason)
            case p.BeginEnding(_, status, reason):
                self.run = replace(run, status=RunStatus.ENDING, ending_status=status, ending_reason=reason)
            case p.DropLeftovers(_, limit):
                for _ in range(min(limit, len(self.groups))):
                    self.trainer_committed += self.groups.popleft()[1]
            case p.FinishRun(_, status, reason):
                self.run = replace(run, status=status, ending_reason=reason)
            case _:  # BillPod, CloseEntry of a pod never launched, RecordTrainingFailure: the simulated world never needs them
                raise AssertionError(f"the simulated world does not expect {action}")

    def _launch_on_training_node(self, name: str, role: str, spot: bool, zone: int, labels: dict[str, str]) -> _Pod:
        """A training or standby pod: on a warm node of its pool if there is one (a standby's, which
        a job takes over, or one just left), else on a new one; a spot one waits for a node while
        its zone's training trace has none free."""
        capacity, pool = "spot" if spot else "on-demand", training_pool(zone)
        warm = [
            s
            for s in self.pods.values()
            if s.status.role == ROLE_STANDBY
            and s.status.phase == PodPhase.RUNNING
            and (s.status.capacity_type, self._pool_of(s.status.name)) == (capacity, pool)
            and not s.status.waiting_for_node
        ]
        just_left = self.now - self.node_released_at.get((capacity, pool), -math.inf) <= HANDOVER_SECONDS
        nodes = self.spec.training.nodes
        no_node = spot and not warm and not just_left and self._nodes_held(pool) + nodes > self._capacity(pool)
        pod = self._launch(name, role, self.spec.training.instance_type, capacity, labels, pool=pool, nodes=nodes)
        if no_node:  # it waits for a node (_place_waiting)
            pod.status, pod.ready_at = replace(pod.status, waiting_for_node=True), math.inf
            return pod
        ready = [s.ready_at for s in warm] + ([self.now] if just_left else [])
        pod.ready_at = max(self.now, min(ready, default=self.now + self.workload.startup_seconds))
        return pod

    def _launch(
        self, name: str, role: str, instance_type: str, capacity: str, labels: dict[str, str], pool: int, nodes: int = 1
    ) -> _Pod:
        status = PodStatus(
            name=name,
            run_id=RUN_ID,
            role=role,
            instance_type=instance_type,
            capacity_type=capacity,
            labels=labels,
            phase=PodPhase.RUNNING,
            exit_code=None,
            started_at=self.now,
            ended_at=None,
            pid=None,
            nodes=nodes,
        )
        self.pod_pools[name] = pool
        pod = _Pod(status=status, ready_at=self.now + self.workload.startup_seconds)
        for entry in node_names(name, nodes):
            pod.entry_ids.append(self._open_entry(entry, role, instance_type, capacity, pool))
        self.pods[name] = pod
        self._all_pods.append(pod)
        return pod

    def _open_entry(self, name: str, role: str, instance_type: str, capacity: str, pool: int) -> int:
        """The ledger entry of a pod's node, its id."""
        price = self.catalog.get(instance_type)
        per_hour, source = price.price(capacity), price.source
        entry_id = len(self.ledger) + len(self.past_entries)  # the entries opened before this one
        trace = self._trace_of(pool) if capacity == "spot" else None
        if trace is not None and trace.prices is not None:
            per_hour, source = trace.price_at(self.now), f"trace {trace.name}'s prices (billed tick by tick)"
            self.priced_by[entry_id] = trace
        if name in self.ledger:  # a training job of an iteration started again (after a preemption)
            self.past_entries.append(self.ledger[name])
        self.ledger[name] = LedgerEntry(
            id=entry_id,
            run_id=RUN_ID,
            role=role,
            pod=name,
            instance_type=instance_type,
            capacity_type=capacity,
            price_per_hour=per_hour * self._share(role, instance_type),
            price_source=source,
            started_at=self.now,
            ended_at=None,
        )
        return entry_id

    def _train_batch(self) -> None:
        """The job's batch: the first ``batch_samples`` queued, less those beyond the staleness bound."""
        version, taken = self.run.iterations_done, 0
        while self.groups and taken < self.spec.batch_samples:
            made_by, samples = self.groups.popleft()
            taken += samples
            if version - made_by > self.spec.staleness_bound:
                self.stale += samples
            else:
                self.trained += samples
        self.trainer_committed += taken


def simulate(
    trace: SpotTrace | Sequence[SpotTrace],
    policy: CostPolicy,
    workload: Workload = Workload(),
    catalog: PriceCatalog | None = None,
    training_trace: SpotTrace | Sequence[SpotTrace] | None = None,
) -> SimResult:
    """Run ``workload`` under ``policy`` on ``trace`` (spot rollout nodes; several traces: one per
    rollout option, the pool's instance type in each trace's zone, the first its own) and
    ``training_trace`` (spot training nodes, for ``training_capacity`` spot or auto; several: one per
    spot zone, each trace's zone) until the run ends; its bill and figures."""
    catalog = catalog or load_catalog()
    # Refuses instance types priced in two currencies before simulating (a MixedCurrencyError).
    catalog.currency_of([workload.rollout_instance_type, workload.training_instance_type])
    traces = _traces(trace)
    training_traces = _traces(training_trace)
    several = len(training_traces) > 1 and workload.training_capacity != TrainingCapacity.ON_DEMAND
    spec = workload.spec(
        policy,
        zones=[zone_name(t.name) for t in traces[1:]],
        training_zones=[zone_name(t.name) for t in training_traces] if several else (),
    )
    world = _World(spec=spec, workload=workload, traces=traces, catalog=catalog, training_traces=training_traces)
    world.run = RunState(run_id=RUN_ID, status=RunStatus.PENDING, spec=spec)
    while not world.run.status.is_terminal() and world.now < workload.horizon_days * 86400.0:
        for action in p.plan(world.run, world.observed()):
            world.apply(action)
        world.advance(workload.tick_seconds)
    return _result(world, policy)


def _traces(traces: SpotTrace | Sequence[SpotTrace] | None) -> tuple[SpotTrace, ...]:
    return () if traces is None else (traces,) if isinstance(traces, SpotTrace) else tuple(traces)


def zone_name(trace_name: str) -> str:
    """A zone named after its trace (the characters a zone may have)."""
    return re.sub(r"[^a-z0-9-]+", "-", trace_name.lower()).strip("-")[:63] or "zone"


def _result(world: _World, policy: CostPolicy) -> SimResult:
    w, spec, catalog = world.workload, world.spec, world.catalog
    started, ended = world.run.started_at or 0.0, world.now
    entries = world.billed_ledger(ended)
    terms = TrainingTerms.of_stored(spec.model_dump(mode="json"))
    report = cost_report(
        entries,
        catalog=catalog,
        training=terms,
        rollout=RolloutTerms(spec.rollout.gpus_per_worker),
        run_started_at=started,
        run_ended_at=ended,
        now=ended,
    )
    trained_batches = world.run.iterations_done
    rollout_busy = trained_batches * spec.batch_samples / (w.worker_samples_per_hour / 3600.0)
    training_busy = trained_batches * w.training_minutes * 60.0 * spec.training.nodes  # node-seconds
    # The cheapest option's spot price (with trace prices, the cheapest tick's): no schedule pays
    # less for a busy second.
    rollout_price = catalog.get(spec.rollout.instance_type)
    spot_prices = [
        t.cheapest_price() if t.prices is not None else catalog.get(o.instance_type).spot
        for o, t in zip(spec.rollout.choices, world.traces, strict=True)
    ]
    rollout_price = replace(rollout_price, spot=min(spot_prices))
    training_price = catalog.get(spec.training.instance_type)
    if world.training_traces:  # the cheapest zone's, as the rollout's
        spot = min(t.cheapest_price() if t.prices is not None else training_price.spot for t in world.training_traces)
        training_price = replace(training_price, spot=spot)
    worker_share = RolloutTerms(spec.rollout.gpus_per_worker).share(ROLE_ROLLOUT, rollout_price)
    rollout_bound = lower_bound_dollars([Busy(ROLE_ROLLOUT, rollout_busy, rollout_price, worker_share)], terms.spot)
    training_bound = lower_bound_dollars([Busy(ROLE_TRAINING, training_busy, training_price)], terms.spot)
    lower_bound = rollout_bound + training_bound
    billed = {e.id: e for e in entries}
    node_seconds = sum(e.seconds(ended) for e in entries if e.role != ROLE_ROLLOUT)
    wall = ended - started
    return SimResult(
        policy=policy.value,
        currency=report.currency,
        dollars=round(report.total_dollars, 4),
        wall_seconds=round(wall, 1),
        lower_bound_dollars=round(lower_bound, 4),
        always_on_dollars=round(report.always_on_dollars, 4),
        samples_trained=world.trained,
        samples_dropped_stale=world.stale,
        preemptions=world.preemptions,
        training_preemptions=world.training_preemptions,
        training_busy_fraction=round(training_busy / node_seconds, 4) if node_seconds else 0.0,
        deadline_met=None
        if w.deadline_seconds is None
        else world.run.status.is_terminal() and wall <= w.deadline_seconds,
        finished=world.run.status.is_terminal(),
        gap=gap(
            [_span(pod, billed[entry], ended) for pod in world._all_pods for entry in pod.entry_ids],
            report.total_dollars,
            rollout_bound,
            training_bound,
        ),
    )


def _span(pod: _Pod, entry: LedgerEntry, now: float) -> PodSpan:
    end = entry.ended_at if entry.ended_at is not None else now
    if pod.status.role == ROLE_ROLLOUT:
        busy = pod.generation_seconds
    elif pod.status.role == ROLE_TRAINING and pod.done_at is not None:
        busy = max(0.0, min(pod.done_at, end) - pod.ready_at)
    else:  # a standby holds the node and runs nothing
        busy = 0.0
    return PodSpan(
        rollout=pod.status.role == ROLE_ROLLOUT,
        started_at=entry.started_at,
        ready_at=pod.ready_at,
        ended_at=end,
        busy_seconds=busy,
        price_per_hour=entry.price_per_hour,
    )
