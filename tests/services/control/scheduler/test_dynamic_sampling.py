"""DAPO dynamic sampling's accounting through a whole run (the test plays the rollout worker and
the training job, conftest.ScriptedLauncher): the groups a worker drops before queueing are the
run's ``samples_filtered``, which survive the run's end beside the queued samples' counts, show
in /metrics under their own reason, and the audit accounts for them."""

from __future__ import annotations

import uuid

from prometheus_client import CollectorRegistry

from contracts.messages import PromptMessage
from contracts.samples import Sample, encode_group
from contracts.status import RunStatus
from services.control.api.metrics import RunCollector
from services.control.api.service import run_public
from services.control.scheduler.loop import Scheduler
from services.core.config import Settings
from services.data.rollout.dynamic_sampling import informative_groups
from services.domain.names import ROLLOUT_GROUP, prompts_topic, samples_topic
from services.domain.runspec import RunSpec
from services.ports.queue.queue import next_offsets
from services.ports.wiring import Backends
from services.tooling.run_audit import audit_run
from tests.services.control.scheduler.test_accounting import SPEC, job, publish

DAPO = RunSpec.model_validate(
    {**SPEC.model_dump(), "iterations": 1, "training": {**SPEC.training.model_dump(), "dynamic_sampling": True}}
)


def generate(b: Backends, run_id: str) -> int:
    """One pass of a rollout worker over the queued prompts, as ``RolloutWorker.run`` does: a group
    of 4 per prompt, all rewards equal for even prompt ids (dropped and counted), mixed for odd
    ones (queued); then the prompts are committed. Returns how many prompts it took."""
    consumer = b.queue.consumer(prompts_topic(run_id), ROLLOUT_GROUP, member_id="worker", session_timeout_s=60.0)
    try:
        records = consumer.poll(100, timeout_s=1.0)
        samples = []
        for r in records:
            prompt_id, group = PromptMessage.decode(r.value).prompt_id, uuid.uuid4().hex
            mixed = int(prompt_id) % 2 == 1
            samples += [
                Sample(
                    sample_id=uuid.uuid4().hex,
                    run_id=run_id,
                    prompt_id=prompt_id,
                    group_id=group,
                    prompt_ids=[5],
                    response_ids=[7, k],
                    logprobs=[-1.0, -1.0],
                    reward=float(k % 2) if mixed else 0.0,
                    reward_source="rule",
                    policy_version=0,
                    worker_id="worker",
                    generation_seconds=0.0,
                    created_at=0.0,
                )
                for k in range(4)
            ]
        groups, dropped = informative_groups(samples)
        if dropped:
            b.state.count_filtered_samples(run_id, dropped)
        if groups:
            b.queue.produce(
                samples_topic(run_id), [encode_group(g) for g in groups], keys=[g[0].group_id.encode() for g in groups]
            )
        if records:
            consumer.commit(next_offsets(records))
        return len(records)
    finally:
        consumer.close()


def test_dynamic_sampling_drops_are_counted_apart_and_survive_the_runs_end(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    run_id = submit(b, DAPO)
    scheduler.tick()  # started
    taken = 0
    while not [p for p in launcher.list(run_id) if p.role == "training"]:
        assert taken < 8, "the scheduler kept publishing without launching training"
        scheduler.tick()  # publishes prompts until a batch is queued (dropped groups make it publish more)
        taken += generate(b, run_id)
    assert taken == 4  # prompts 0 and 2 dropped, 1 and 3 queued: one batch of 8
    assert b.state.get_run(run_id).samples_filtered == 8
    publish(b, run_id, 1, commit=True)
    launcher.end(job(b, 1).name, 0)
    for _ in range(6):
        scheduler.tick()  # records iteration 1 (the last); stops the worker, reaps it, ends the run
    run = b.state.get_run(run_id)
    assert run.status == RunStatus.SUCCEEDED, run.status_reason
    # _finish recounted the queued samples' drops and left dynamic sampling's alone.
    assert (run.samples_produced, run.samples_trained, run.samples_dropped, run.samples_filtered) == (8, 8, 0, 8)
    shown = run_public(b.state.run_view(run_id, latest=100), spent=0.0).samples  # as GET /v1/runs/{id} shows them
    assert (shown.produced, shown.trained, shown.dropped, shown.filtered) == (8, 8, 0, 8)

    audit = audit_run(b, run_id)
    assert audit.problems == []
    assert (audit.produced, audit.trained, audit.dropped, audit.filtered) == (8, 8, 0, 8)
    assert audit.prompts_committed == 4  # two of them with no queued group: their groups were dropped

    registry = CollectorRegistry()
    registry.register(RunCollector(b))
    by_reason = {
        reason: registry.get_sample_value("spotrl_samples_dropped_by_reason_total", {"run": run_id, "reason": reason})
        for reason in ("dynamic_sampling", "run_ended")
    }
    assert by_reason == {"dynamic_sampling": 8, "run_ended": 0}
    assert registry.get_sample_value("spotrl_samples_dropped_total", {"run": run_id}) == 0


def test_the_audit_finds_committed_prompts_whose_groups_were_neither_queued_nor_dropped(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    """The allowance for dropped groups is no blank cheque: drops beyond what was counted, or
    counted without dynamic sampling, are problems."""
    b = scripted_backends
    scheduler = Scheduler(b, settings)
    run_id = submit(b, DAPO)
    scheduler.tick()
    scheduler.tick()  # publishes prompts 0 and 1
    generate(b, run_id)
    b.state.update_run(run_id, samples_filtered=0)  # the worker's count of prompt 0's group lost
    b.state.request_cancel(run_id)
    for _ in range(6):
        scheduler.tick()
    assert b.state.get_run(run_id).status == RunStatus.CANCELLED
    (problem,) = audit_run(b, run_id).problems
    assert "prompts committed without their samples" in problem and "1 groups missing, 0 dropped" in problem

    plain = submit(b, SPEC)
    b.state.count_filtered_samples(plain, 4)
    b.state.request_cancel(plain)
    for _ in range(3):
        scheduler.tick()
    assert audit_run(b, plain).problems == ["4 samples dropped before queueing, without dynamic sampling"]
