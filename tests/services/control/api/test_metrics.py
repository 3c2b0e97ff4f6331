"""The API's /metrics collector exports what pods recorded in the state store, by run."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from contracts.status import RunStatus
from services.control.api.metrics import RunCollector
from services.control.cost.lower_bound import TrainingTerms
from services.control.cost.report import cost_report
from services.core.config import Settings
from services.domain.names import prompts_topic, samples_topic
from services.ports.launcher.launcher import PodOutcome, PodPhase, PodStatus, pod_outcome
from services.ports.prices.catalog import load_catalog
from services.ports.wiring import open_backends
from tests.iteration_rows import iteration_row


def test_pods_and_training_recorded_in_the_store_are_exported_by_run(settings: Settings) -> None:
    b = open_backends(settings)
    registry = CollectorRegistry()
    registry.register(RunCollector(b, load_catalog()))
    b.state.create_run("r1", name=None, spec={"training": {"instance_type": "p4d.24xlarge"}})
    for topic in (prompts_topic("r1"), samples_topic("r1")):
        b.queue.create_topic(topic, 1)
    b.state.set_status("r1", RunStatus.RUNNING)
    b.queue.produce(samples_topic("r1"), [b"one group"])  # of samples_per_prompt (4 by default) samples
    now = time.time()
    bill = dict(
        run_id="r1",
        role="rollout",
        instance_type="g6.xlarge",
        capacity_type="spot",
        price_per_hour=0.5,
        price_source="test",
    )
    b.state.open_ledger(pod="r1-rollout-0", started_at=now - 100, **bill)
    b.state.open_ledger(pod="r1-rollout-1", started_at=now - 100, **bill)
    b.state.close_ledger("r1-rollout-1", ended_at=now - 50, outcome=PodOutcome.PREEMPTED)
    b.state.report_worker("r1", "r1-rollout-0", samples=6, generation_seconds=3.0, reward_cache={"hit": 2, "miss": 4})
    b.state.report_worker(
        "r1", "r1-rollout-0", samples=0, generation_seconds=0.0, reward_cache={}, generation_batch=24
    )  # set, not added
    b.state.record_iteration(
        iteration_row(
            "r1",
            1,
            mean_reward=0.25,
            kl=0.01,
            seconds=12.0,
            samples_dropped=2,
            ended_at=now,
            metrics={
                "actor/pg_clipfrac": 0.1,
                "actor/ppo_kl": 0.01,
                "data/staleness_mean": 0.5,
                "data/dropped_stale": 2.0,
            },
        )
    )

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"run": "r1", **labels})

    assert (
        value(
            "spotrl_worker_samples_produced_total",
            role="rollout",
            capacity_type="spot",
            instance_type="g6.xlarge",
            worker="r1-rollout-0",
        )
        == 6
    )
    assert (
        value(
            "spotrl_worker_samples_produced_total",
            role="rollout",
            capacity_type="spot",
            instance_type="g6.xlarge",
            worker="r1-rollout-1",
        )
        == 0
    )  # launched, never reported
    assert value("spotrl_reward_cache_requests_total", result="hit") == 2
    rollout_0 = dict(role="rollout", capacity_type="spot", instance_type="g6.xlarge", worker="r1-rollout-0")
    assert value("spotrl_worker_generation_batch", **rollout_0) == 24
    assert value("spotrl_worker_generation_batch", **{**rollout_0, "worker": "r1-rollout-1"}) is None
    assert value("spotrl_reward_cache_requests_total", result="error") == 0
    where = dict(role="rollout", capacity_type="spot", instance_type="g6.xlarge")
    assert value("spotrl_spot_preemptions_total", **where) == 1
    assert value("spotrl_pods_ended_total", **where, outcome="preempted") == 1
    assert value("spotrl_cost_dollars_per_hour", **where) == 0.5  # the one still running
    assert value("spotrl_training_clip_fraction") == 0.1
    assert value("spotrl_training_kl") == 0.01
    assert value("spotrl_training_step_seconds") == 12.0
    assert value("spotrl_training_entropy") is None  # not in the loss, not reported
    assert value("spotrl_sample_staleness_mean") == 0.5
    assert value("spotrl_samples_dropped_by_reason_total", reason="stale") == 2
    assert value("spotrl_prompt_backlog") == 0
    assert value("spotrl_sample_backlog") == 4
    assert value("spotrl_training_mean_reward") == 0.25
    assert value("spotrl_mean_reward") is None  # one family for the latest iteration's mean reward
    # Savings and efficiency are the cost report's, not computed twice.
    report = cost_report(
        b.state.ledger("r1"),
        catalog=load_catalog(),
        training=TrainingTerms("p4d.24xlarge"),
        run_started_at=b.state.get_run("r1").started_at,
        run_ended_at=None,
        now=time.time(),
    )
    assert value("spotrl_run_cost_efficiency") == pytest.approx(report.efficiency, rel=0.05)
    assert value("spotrl_run_savings_ratio") == pytest.approx(report.savings_ratio, rel=0.05)
    b.close()


def test_a_pod_preempted_or_killed_by_a_signal_is_told_from_one_that_failed() -> None:
    def ended(phase: PodPhase, code: int | None, preempted: bool = False) -> PodStatus:
        return PodStatus(
            name="p",
            run_id="r",
            role="rollout",
            instance_type="g6.xlarge",
            capacity_type="spot",
            labels={},
            phase=phase,
            exit_code=code,
            started_at=0.0,
            ended_at=1.0,
            pid=None,
            preempted=preempted,
        )

    assert pod_outcome(ended(PodPhase.FAILED, -15, preempted=True)) == PodOutcome.PREEMPTED

    assert pod_outcome(ended(PodPhase.SUCCEEDED, 0)) == PodOutcome.SUCCEEDED
    assert pod_outcome(ended(PodPhase.FAILED, -9)) == PodOutcome.KILLED
    assert pod_outcome(ended(PodPhase.FAILED, 1)) == PodOutcome.FAILED
    assert pod_outcome(ended(PodPhase.FAILED, None)) == PodOutcome.FAILED
