"""Prometheus metrics of the API process, read from the state store and queue at scrape time.

One scrape of the API's /metrics covers every run, wherever its pods run. Pods do not serve
metrics of their own: a rollout worker adds what it did to its counters in the state store
after each batch (``StateStore.report_worker``: samples, generation seconds, reward cache keys
by result), a training job's iteration metrics arrive with its result (``iterations.metrics``),
and pods' lives and prices are in the cost ledger. Why not a scrape port per pod: pods in
Kubernetes are short-lived (a training job lives for one iteration, a spot worker until its
node is reclaimed), so a scraper would miss a job that ended between two scrapes and lose a
killed worker's last counts; a pod's counters would restart at zero with every replacement,
and each pod would need a Service or PodMonitor. Through the state store nothing is lost
between scrapes, the counters of a worker that restarts under its name keep growing, and the
Helm chart needs one ServiceMonitor. The price is one small write per batch per worker.

Every family is level-triggered: each scrape reads the current state, so an API restart loses
nothing. Names and labels follow docs/architecture.md ("Metrics and trackers"): ``spotrl_*`` with ``run``, and
``role``, ``capacity_type``, ``instance_type`` where they apply. GPU utilization is not here:
DCGM exporter's ``DCGM_FI_DEV_GPU_UTIL{pod}`` joins to ``spotrl_pod_info{pod}`` in the dashboards.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from contracts.status import RunStatus
from services.control.cost.billing import RolloutTerms, billed_dollars
from services.control.cost.lower_bound import LOWER_BOUND_MEANING, TrainingTerms
from services.control.cost.report import cost_report
from services.domain.backlog import sample_backlog
from services.domain.names import ROLE_ROLLOUT, ROLLOUT_GROUP, prompts_topic
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodOutcome, PodPhase
from services.ports.prices.catalog import PriceCatalog, load_catalog
from services.ports.state.state_schema import IterationRow, RunRow
from services.ports.state.state_store import LedgerEntry
from services.ports.wiring import Backends

GROUP_SIZE_DEFAULT = RunSpec.model_fields["samples_per_prompt"].default

# Outcomes of a spot pod that count as a preemption (``services.ports.launcher.launcher.pod_outcome``).
PREEMPTED = frozenset({PodOutcome.PREEMPTED.value})

# Runs that ended longer ago than this are left out of the per-run series: Prometheus already
# holds their final values, and re-reading every old run's ledger and iterations at each scrape
# would grow without bound.
ENDED_RUNS_KEPT_S = 3600.0

# Training metrics of a run's latest iteration: (family, the iteration metric key, help). The keys
# are those trainer_core's update reports (verl/CleanRL style); entropy only with entropy_coef > 0.
TRAINING_GAUGES = (
    (
        "spotrl_training_kl",
        "kl",
        "KL of the latest iteration: to the reference policy, or from the behaviour policy without one.",
    ),
    (
        "spotrl_training_clip_fraction",
        "actor/pg_clipfrac",
        "Fraction of response tokens whose ratio was clipped (actor/pg_clipfrac).",
    ),
    (
        "spotrl_training_entropy",
        "actor/entropy",
        "Policy entropy per token (actor/entropy; runs with training.entropy_coef > 0).",
    ),
    (
        "spotrl_sample_staleness_mean",
        "data/staleness_mean",
        "Mean policy versions between a trained sample's generator and the policy updated.",
    ),
    (
        "spotrl_sample_staleness_max",
        "data/staleness_max",
        "Most policy versions between a trained sample's generator and the policy updated.",
    ),
)
DROP_REASONS = ("duplicate", "stale", "uneven")  # iteration metrics data/dropped_<reason>; the rest: run_ended
# Dropped by rollout workers before queueing (the run's samples_filtered), not among the queued samples' drops.
DYNAMIC_SAMPLING = "dynamic_sampling"

_POD = ["run", "role", "capacity_type", "instance_type"]


class RunCollector(Collector):
    """Level metrics: every scrape reads the current state, so restarts lose nothing."""

    def __init__(self, backends: Backends, catalog: PriceCatalog | None = None) -> None:
        self.b = backends
        self.catalog = catalog or load_catalog()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = time.time()
        runs = self.b.state.list_runs()
        by_status = GaugeMetricFamily("spotrl_runs", "Runs by status.", labels=["status"])
        for status in RunStatus:
            by_status.add_metric([status.value], sum(r.status == status.value for r in runs))
        yield by_status

        f = _Families()
        for r in runs:
            if r.ended_at is None or now - r.ended_at <= ENDED_RUNS_KEPT_S:
                self._run(f, r, now)
        yield from f.all()

        pods = GaugeMetricFamily("spotrl_pods", "Running pods, on a node.", labels=_POD)
        waiting = GaugeMetricFamily(
            "spotrl_pods_waiting_for_node",
            "Running pods that no node has taken yet (no capacity of their kind): nothing is billed for them.",
            labels=_POD,
        )
        info = GaugeMetricFamily(
            "spotrl_pod_info",
            "1 for each pod on a node: join DCGM_FI_DEV_GPU_UTIL{pod} to a run and role.",
            labels=[*_POD, "pod"],
        )
        on_node: dict[tuple[str, str, str, str], int] = defaultdict(int)
        unplaced: dict[tuple[str, str, str, str], int] = defaultdict(int)
        for pod in self.b.launcher.list():
            if pod.phase == PodPhase.RUNNING:
                key = (pod.run_id, pod.role, pod.capacity_type, pod.instance_type)
                if pod.waiting_for_node:
                    unplaced[key] += 1
                else:
                    on_node[key] += 1
                    info.add_metric([*key, pod.platform_name or pod.name], 1)  # the name dcgm-exporter labels it with
        for key in sorted(on_node.keys() | unplaced.keys()):  # both series for each key, 0 included
            pods.add_metric(list(key), on_node[key])
            waiting.add_metric(list(key), unplaced[key])
        yield pods
        yield waiting
        yield info

    def _run(self, f: _Families, r: RunRow, now: float) -> None:
        run = r.id
        f.version.add_metric([run], r.policy_version)
        if not RunStatus(r.status).is_terminal() and r.started_at is not None:
            group_size = r.spec.get("samples_per_prompt", GROUP_SIZE_DEFAULT)  # a sample record is a group
            f.backlog.add_metric([run], sample_backlog(self.b.queue, run, group_size).queued)
            f.prompt_backlog.add_metric([run], self.b.queue.backlog(prompts_topic(run), ROLLOUT_GROUP))
        f.produced.add_metric([run], r.samples_produced)
        f.trained.add_metric([run], r.samples_trained)
        f.dropped.add_metric([run], r.samples_dropped)
        f.iterations.add_metric([run], r.iterations_done)
        if r.last_mean_reward is not None:
            f.training_reward.add_metric([run], r.last_mean_reward)
        entries = self.b.state.ledger(r.id)
        self._ledger(f, r, entries, now)
        self._iterations(f, r)
        self._workers(f, r, entries)
        if r.spec.get("eval"):
            self._evals(f, r)

    def _ledger(self, f: _Families, r: RunRow, entries: list[LedgerEntry], now: float) -> None:
        dollars: dict[tuple[str, ...], float] = defaultdict(float)
        seconds: dict[tuple[str, ...], float] = defaultdict(float)
        per_hour: dict[tuple[str, ...], float] = defaultdict(float)
        ended: dict[tuple[str, ...], int] = defaultdict(int)
        preempted: dict[tuple[str, ...], int] = {}
        for e, billed in zip(entries, billed_dollars(entries, self.catalog, now), strict=True):
            key = (r.id, e.role, e.capacity_type, e.instance_type)
            dollars[key] += billed  # the cost report's figure
            seconds[key] += e.seconds(now)
            per_hour[key] += e.price_per_hour if e.ended_at is None else 0.0  # 0 once all ended: "now" stays a series
            if e.ended_at is not None:
                ended[(*key, e.outcome or "unknown")] += 1
            if e.capacity_type == "spot":
                preempted[key] = preempted.get(key, 0) + (e.outcome in PREEMPTED)
        for key, value in dollars.items():
            f.cost.add_metric(list(key), value)
            f.pod_seconds.add_metric(list(key), seconds[key])
            f.cost_rate.add_metric(list(key), per_hour[key])
        for key, n in ended.items():
            f.pods_ended.add_metric(list(key), n)
        for key, n in preempted.items():
            f.preemptions.add_metric(list(key), n)
        if not entries:
            return
        report = cost_report(
            entries,
            catalog=self.catalog,
            training=TrainingTerms.of_stored(r.spec),
            rollout=RolloutTerms.of_stored(r.spec),
            run_started_at=r.started_at,
            run_ended_at=r.ended_at,
            now=now,
        )
        f.always_on.add_metric([r.id], report.always_on_dollars)
        f.lower_bound.add_metric([r.id], report.lower_bound_dollars)
        if report.savings_ratio is not None:
            f.savings.add_metric([r.id], report.savings_ratio)
        if report.efficiency is not None:
            f.efficiency.add_metric([r.id], report.efficiency)

    def _iterations(self, f: _Families, r: RunRow) -> None:
        iterations = self.b.state.iterations(r.id)
        self._dropped_by_reason(f, r, iterations)
        if not iterations:
            return
        last = iterations[-1]
        metrics: dict[str, Any] = {**last.metrics, "kl": last.kl}
        f.step_seconds.add_metric([r.id], last.seconds)
        f.training_iteration.add_metric([r.id], last.iteration)
        for family, key, _ in TRAINING_GAUGES:
            if metrics.get(key) is not None:
                f.training[family].add_metric([r.id], metrics[key])
        f.busy.add_metric([r.id], sum(it.seconds for it in iterations))

    def _evals(self, f: _Families, r: RunRow) -> None:
        """The latest recorded held-out eval (the highest policy version evaluated)."""
        evals = self.b.state.evals(r.id, latest=1)
        if not evals:
            return
        last = evals[-1]
        f.eval_version.add_metric([r.id], last.policy_version)
        for name, value in sorted((last.metrics or {}).items()):
            f.eval_score.add_metric([r.id, name], value)

    def _dropped_by_reason(self, f: _Families, r: RunRow, iterations: list[IterationRow]) -> None:
        """Also before the first iteration: dynamic sampling drops from the first batch on."""
        by_reason = {
            reason: sum(int(it.metrics.get(f"data/dropped_{reason}") or 0) for it in iterations)
            for reason in DROP_REASONS
        }
        # Dropped beyond the iterations' own: samples still queued when the run ended.
        by_reason["run_ended"] = max(0, r.samples_dropped - sum(it.samples_dropped for it in iterations))
        by_reason[DYNAMIC_SAMPLING] = r.samples_filtered
        for reason, n in by_reason.items():
            f.dropped_by_reason.add_metric([r.id, reason], n)

    def _workers(self, f: _Families, r: RunRow, entries: list[LedgerEntry]) -> None:
        """Each rollout worker's counters, at 0 from its pod's launch (its ledger entry opens
        first) until its first report: a rate over the first batch needs that baseline."""
        if r.started_at is None:
            return
        stats = {w.worker: w for w in self.b.state.worker_stats(r.id)}
        # A worker's id is its pod's name, so its ledger entry tells where it runs.
        where = {e.pod: (e.capacity_type, e.instance_type) for e in entries if e.role == ROLE_ROLLOUT}
        cache = {"hit": 0, "miss": 0, "error": 0}
        for worker in sorted(where.keys() | stats.keys()):
            capacity, instance = where.get(worker, ("unknown", "unknown"))
            labels = [r.id, ROLE_ROLLOUT, capacity, instance, worker]
            w = stats.get(worker)
            f.worker_samples.add_metric(labels, w.samples_produced if w else 0)
            f.worker_generation.add_metric(labels, w.generation_seconds if w else 0.0)
            if w is not None:
                f.worker_report.add_metric(labels, w.reported_at)
                if w.generation_batch is not None:
                    f.worker_batch.add_metric(labels, w.generation_batch)
                cache["hit"] += w.reward_cache_hits
                cache["miss"] += w.reward_cache_misses
                cache["error"] += w.reward_cache_errors
        for result, n in cache.items():
            f.cache.add_metric([r.id, result], n)


class _Families:
    """The per-run families of one scrape."""

    def __init__(self) -> None:
        """One family per statement, name and help text side by side: a declaration list, which
        is long because the families are many; split, they would read as pieces of one list."""
        run = ["run"]
        worker = [*_POD, "worker"]
        self.version = GaugeMetricFamily("spotrl_policy_version", "Latest published policy version.", labels=run)
        self.backlog = GaugeMetricFamily("spotrl_sample_backlog", "Samples queued and not yet trained.", labels=run)
        self.prompt_backlog = GaugeMetricFamily(
            "spotrl_prompt_backlog", "Prompts queued and not yet generated from.", labels=run
        )
        self.produced = CounterMetricFamily("spotrl_samples_produced", "Samples queued by rollout workers.", labels=run)
        self.trained = CounterMetricFamily("spotrl_samples_trained", "Samples used by training.", labels=run)
        self.dropped = CounterMetricFamily(
            "spotrl_samples_dropped",
            "Queued samples discarded, not trained (produced = trained + dropped).",
            labels=run,
        )
        self.dropped_by_reason = CounterMetricFamily(
            "spotrl_samples_dropped_by_reason",
            "Samples discarded, by reason: duplicate, stale (beyond the staleness bound), uneven (data-parallel shares), "
            "run_ended (still queued when the run ended); and dynamic_sampling (groups whose rewards were all equal, "
            "dropped by rollout workers before queueing: in neither spotrl_samples_produced nor spotrl_samples_dropped).",
            labels=[*run, "reason"],
        )
        self.iterations = CounterMetricFamily("spotrl_training_iterations", "Training iterations finished.", labels=run)
        self.training_reward = GaugeMetricFamily(
            "spotrl_training_mean_reward", "Mean reward of the trained samples of the latest iteration.", labels=run
        )
        self.training_iteration = GaugeMetricFamily(
            "spotrl_training_iteration", "The latest iteration recorded.", labels=run
        )
        self.step_seconds = GaugeMetricFamily(
            "spotrl_training_step_seconds", "Wall seconds of the latest iteration's training job work.", labels=run
        )
        self.training = {name: GaugeMetricFamily(name, doc, labels=run) for name, _, doc in TRAINING_GAUGES}
        self.busy = CounterMetricFamily(
            "spotrl_training_busy_seconds",
            "Seconds training jobs spent on their iterations' work (sum of step seconds).",
            labels=run,
        )
        self.cost = CounterMetricFamily("spotrl_run_cost_dollars", "Dollars spent.", labels=_POD)
        self.cost_rate = GaugeMetricFamily(
            "spotrl_cost_dollars_per_hour", "What the run's running pods cost per hour now.", labels=_POD
        )
        self.pod_seconds = CounterMetricFamily("spotrl_pod_seconds", "Seconds of pods billed.", labels=_POD)
        self.pods_ended = CounterMetricFamily(
            "spotrl_pods_ended",
            "Pods ended, by outcome (succeeded, failed, killed, preempted; unknown before it was recorded).",
            labels=[*_POD, "outcome"],
        )
        self.preemptions = CounterMetricFamily(
            "spotrl_spot_preemptions",
            "Spot pods preempted: their machine taken back (the launcher's PodStatus.preempted).",
            labels=_POD,
        )
        self.always_on = GaugeMetricFamily(
            "spotrl_run_always_on_dollars",
            "What the same work would have cost on an always-on on-demand cluster.",
            labels=run,
        )
        self.lower_bound = GaugeMetricFamily(
            "spotrl_run_lower_bound_dollars",
            LOWER_BOUND_MEANING,
            labels=run,
        )
        self.savings = GaugeMetricFamily(
            "spotrl_run_savings_ratio", "Always-on dollars over dollars spent (2 = half the price).", labels=run
        )
        self.efficiency = GaugeMetricFamily(
            "spotrl_run_cost_efficiency",
            "Lower-bound dollars over dollars spent (1 = nothing paid for idle or dear capacity).",
            labels=run,
        )
        self.worker_samples = CounterMetricFamily(
            "spotrl_worker_samples_produced", "Samples a rollout worker queued.", labels=worker
        )
        self.worker_generation = CounterMetricFamily(
            "spotrl_worker_generation_seconds",
            "Seconds a rollout worker spent generating, summed over its samples.",
            labels=worker,
        )
        self.worker_report = GaugeMetricFamily(
            "spotrl_worker_last_report_timestamp_seconds",
            "When a rollout worker last reported (unix seconds).",
            labels=worker,
        )
        self.worker_batch = GaugeMetricFamily(
            "spotrl_worker_generation_batch",
            "The most sequences a rollout worker generated at once in its latest batch, as sized from its free memory.",
            labels=worker,
        )
        self.eval_score = GaugeMetricFamily(
            "spotrl_eval_score",
            "The latest held-out eval's metrics by name (mean score, pass@k).",
            labels=[*run, "metric"],
        )
        self.eval_version = GaugeMetricFamily(
            "spotrl_eval_policy_version",
            "The policy version of the latest held-out eval (0: the base model).",
            labels=run,
        )
        self.cache = CounterMetricFamily(
            "spotrl_reward_cache_requests",
            "Reward cache keys by result (hit, miss, error), as the run's workers reported them.",
            labels=[*run, "result"],
        )

    def all(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for value in vars(self).values():
            if isinstance(value, dict):
                yield from value.values()
            else:
                yield value
