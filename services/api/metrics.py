"""Prometheus metrics of the API process, read from the state store and queue at scrape time."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from contracts.status import RunStatus
from services.backends.launcher import PodPhase
from services.names import TRAINER_GROUP, samples_topic
from services.runspec import RunSpec
from services.wiring import Backends


class RunCollector(Collector):
    """Level metrics: every scrape reads the current state, so restarts lose nothing."""

    def __init__(self, backends: Backends) -> None:
        self.b = backends

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = time.time()
        runs = self.b.state.list_runs()
        by_status = GaugeMetricFamily("spotrl_runs", "Runs by status.", labels=["status"])
        for status in RunStatus:
            by_status.add_metric([status.value], sum(r.status == status.value for r in runs))
        yield by_status

        version = GaugeMetricFamily("spotrl_policy_version", "Latest published policy version.", labels=["run"])
        backlog = GaugeMetricFamily("spotrl_sample_backlog", "Samples queued and not yet trained.", labels=["run"])
        produced = CounterMetricFamily("spotrl_samples_produced", "Samples queued by rollout workers.", labels=["run"])
        trained = CounterMetricFamily("spotrl_samples_trained", "Samples used by training.", labels=["run"])
        dropped = CounterMetricFamily("spotrl_samples_dropped", "Samples discarded.", labels=["run"])
        iterations = CounterMetricFamily("spotrl_training_iterations", "Training iterations finished.", labels=["run"])
        reward = GaugeMetricFamily("spotrl_mean_reward", "Mean reward of the last iteration.", labels=["run"])
        cost = CounterMetricFamily(
            "spotrl_run_cost_dollars", "Dollars spent.", labels=["run", "role", "capacity_type", "instance_type"]
        )
        for r in runs:
            version.add_metric([r.id], r.policy_version)
            if not RunStatus(r.status).is_terminal() and r.started_at is not None:
                group_size = RunSpec.from_stored(r.spec).samples_per_prompt  # a record is a group of samples
                backlog.add_metric([r.id], group_size * self.b.queue.backlog(samples_topic(r.id), TRAINER_GROUP))
            produced.add_metric([r.id], r.samples_produced)
            trained.add_metric([r.id], r.samples_trained)
            dropped.add_metric([r.id], r.samples_dropped)
            iterations.add_metric([r.id], r.iterations_done)
            if r.last_mean_reward is not None:
                reward.add_metric([r.id], r.last_mean_reward)
            totals: dict[tuple[str, str, str], float] = {}
            for e in self.b.state.ledger(r.id):
                key = (e.role, e.capacity_type, e.instance_type)
                totals[key] = totals.get(key, 0.0) + e.dollars(now)
            for (role, capacity, instance), dollars in totals.items():
                cost.add_metric([r.id, role, capacity, instance], dollars)
        yield from (version, backlog, produced, trained, dropped, iterations, reward, cost)

        pods = GaugeMetricFamily("spotrl_pods", "Running pods.", labels=["run", "role", "capacity_type", "instance_type"])
        counts: dict[tuple[str, str, str, str], int] = {}
        for pod in self.b.launcher.list():
            if pod.phase == PodPhase.RUNNING:
                key = (pod.run_id, pod.role, pod.capacity_type, pod.instance_type)
                counts[key] = counts.get(key, 0) + 1
        for key, n in counts.items():
            pods.add_metric(list(key), n)
        yield pods
