"""The loop's bookkeeping on the real embedded stores, the test playing the pods
(conftest.ScriptedLauncher): iterations recorded whatever a published job's end, pods billed
from before they start, bounded work per tick. Each run is checked by ``audit_run``, the audit
of `spotrl demo --chaos`."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest

from contracts.job_result import JobResult
from contracts.samples import Sample, decode_group, encode_group
from contracts.status import RunStatus
from services.control.cost.billing import NODE_BOOT_SECONDS
from services.control.scheduler.loop import Scheduler
from services.control.scheduler.plan import MAX_PROMPTS_PER_TICK
from services.core.config import Settings
from services.domain.backlog import read_backlog, take_batch, trainer_consumer
from services.domain.names import (
    TRAINER_GROUP,
    policy_prefix,
    prompts_topic,
    result_key,
    rollout_pod_name,
    samples_topic,
)
from services.domain.runspec import CostPolicy, RunSpec
from services.ports.launcher.launcher import PodSpec
from services.ports.prices.catalog import load_catalog
from services.ports.wiring import Backends
from services.tooling.run_audit import audit_run

SPEC = RunSpec.model_validate(
    {
        "model": "tiny",
        "prompts": [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(4)],
        "samples_per_prompt": 4,
        "batch_samples": 8,
        "iterations": 4,
        "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 2},
    }
)


def produce(backends: Backends, run_id: str, groups: int) -> None:
    """Queue ``groups`` whole groups of samples, as a rollout worker does."""
    for g in range(groups):
        group = uuid.uuid4().hex
        samples = [
            Sample(
                sample_id=uuid.uuid4().hex,
                run_id=run_id,
                prompt_id=str(g % 4),
                group_id=group,
                prompt_ids=[5, 6],
                response_ids=[7, 8 + k],
                logprobs=[-1.0, -1.0],
                reward=float(k % 2),
                reward_source="rule",
                policy_version=0,
                worker_id="w",
                generation_seconds=0.0,
                created_at=float(g),
            )
            for k in range(4)
        ]
        backends.queue.produce(samples_topic(run_id), [encode_group(samples)], keys=[group.encode()])


def publish(backends: Backends, run_id: str, iteration: int, *, commit: bool) -> JobResult:
    """What training job ``iteration`` does once trained: publish v(N), write its result, commit
    its batch (unless ``commit`` is False: the job dies between the two)."""
    consumer = trainer_consumer(backends.queue, run_id)
    try:
        records, offsets = take_batch(read_backlog(backends.queue, consumer, run_id)[0], SPEC.batch_samples // 4)
        samples = [s for r in records for s in decode_group(r.value)]
        result = JobResult(
            iteration=iteration,
            policy_version=iteration,
            mean_reward=0.5,
            metrics={},
            samples_read=len(samples),
            trained_ids=[s.sample_id for s in samples],
            offsets=offsets,
            seconds=1.0,
            ended_at=0.0,
        )
        backends.objects.put_bytes(policy_prefix(run_id, iteration) + "config.json", b"{}")
        backends.objects.put_bytes(result_key(run_id, iteration), result.to_json())
        if commit:
            consumer.commit(offsets)
        return result
    finally:
        consumer.close()


def job(backends: Backends, iteration: int):
    (pod,) = [p for p in backends.launcher.list() if p.role == "training" and p.labels["iteration"] == str(iteration)]
    return pod


@pytest.mark.parametrize("committed", [True, False], ids=["after-its-commit", "before-its-commit"])
def test_cancel_while_the_last_job_finishes_records_its_iteration(
    scripted_backends: Backends, settings: Settings, submit, committed: bool
) -> None:
    """A defect once: the last job had published v3 (and committed its samples, or not
    yet) when the cancel's SIGTERM ended it. Its pod read Failed and was reaped unrecorded: the
    run reported v2, and 8 samples were neither trained nor dropped (produced 32, trained 16,
    dropped 8); or, not yet committed, counted dropped though v3 had trained them."""
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    run_id = submit(b, SPEC)
    scheduler.tick()  # started
    produce(b, run_id, 8)  # 32 samples: four batches
    for iteration in (1, 2):
        scheduler.tick()  # launches training job `iteration`
        publish(b, run_id, iteration, commit=True)
        launcher.end(job(b, iteration).name, 0)
        scheduler.tick()  # records it
    scheduler.tick()  # launches job 3
    publish(b, run_id, 3, commit=committed)
    b.state.request_cancel(run_id)  # ... and the cancel comes
    for _ in range(6):
        scheduler.tick()  # stops the pods (job 3 reads Failed, -15), reaps them, drops the leftovers, ends
    run = b.state.get_run(run_id)
    assert run.status == RunStatus.CANCELLED
    assert run.policy_version == 3
    assert (run.samples_produced, run.samples_trained, run.samples_dropped) == (32, 24, 8)
    audit = audit_run(b, run_id)
    assert audit.problems == []
    assert audit.policy_versions == [1, 2, 3]


def test_a_job_killed_between_publish_and_commit_is_recorded_not_retried(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    run_id = submit(b, SPEC.model_copy(update={"iterations": 1}))
    scheduler.tick()
    produce(b, run_id, 3)
    scheduler.tick()
    publish(b, run_id, 1, commit=False)
    launcher.end(job(b, 1).name, -9)  # SIGKILLed before its commit
    for _ in range(5):
        scheduler.tick()
    run = b.state.get_run(run_id)
    assert (run.status, run.policy_version, run.train_failures) == (RunStatus.SUCCEEDED, 1, 0)
    assert [a for a in launcher.attempts if "-train-" in a] == [f"{run_id}-train-1"], "no retry of a published job"
    assert (run.samples_produced, run.samples_trained, run.samples_dropped) == (12, 8, 4)
    assert audit_run(b, run_id).problems == []


def test_a_job_of_two_nodes_is_billed_per_node_and_ends_as_one(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    """Each node of a multi-node job has its own ledger entry at the node's price, opened at the
    launch; a failed job (any node's failure ends it) closes them all with its outcome and is
    retried, its relaunch billed anew."""
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    spec = SPEC.model_copy(update={"training": SPEC.training.model_copy(update={"nodes": 2, "processes": 4})})
    run_id = submit(b, spec)
    scheduler.tick()
    produce(b, run_id, 2)
    scheduler.tick()  # training job 1 launched, on 2 nodes
    name = job(b, 1).name
    assert "--nnodes=2" in launcher.commands[name] and "--nproc_per_node=4" in launcher.commands[name]
    ledger = {e.pod: e for e in b.state.ledger(run_id) if e.role == "training"}
    assert sorted(ledger) == [f"{name}-0", f"{name}-1"]
    price = load_catalog().get(spec.training.instance_type).price("on-demand")
    assert all(e.ended_at is None and e.price_per_hour == price for e in ledger.values())

    launcher.end(name, 1)  # a node failed: the job's end
    scheduler.tick()
    closed = [e for e in b.state.ledger(run_id) if e.role == "training"]
    assert [(e.pod, e.outcome) for e in closed] == [(f"{name}-0", "failed"), (f"{name}-1", "failed")]
    assert {e.ended_at for e in closed} == {job_end := closed[0].ended_at} and job_end is not None
    assert b.state.get_run(run_id).train_failures == 1
    assert all(p.role != "training" for p in launcher.list(run_id))  # reaped, to be launched again


class _Died(BaseException):
    """The scheduler's process dying mid-action: no handler of its runs (a SIGKILL runs none)."""


def entries(b: Backends, run_id: str) -> dict[str, list[tuple[float, float | None]]]:
    out: dict[str, list[tuple[float, float | None]]] = {}
    for e in b.state.ledger(run_id):
        out.setdefault(e.pod, []).append((e.started_at, e.ended_at))
    return out


def test_a_launch_that_raises_bills_nothing(scripted_backends: Backends, settings: Settings, submit) -> None:
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    run_id = submit(b, SPEC)
    scheduler.tick()
    launcher.error = RuntimeError("quota exceeded")
    scheduler.tick()  # LaunchWorker(0): the entry is opened first, the launch raises, the entry closes
    (worker_0,) = launcher.attempts
    ((started, ended),) = entries(b, run_id)[worker_0]
    assert ended == started, "a pod that never started is billed nothing"
    assert b.state.get_run(run_id).last_error == "RuntimeError: quota exceeded"
    launcher.error = None
    scheduler.tick()
    (worker,) = launcher.running(run_id, "rollout")
    assert entries(b, run_id)[worker.name] == [(pytest.approx(worker.started_at, abs=1.0), None)]
    assert entries(b, run_id)[worker.name][0][0] <= worker.started_at, "billed from before the pod starts"


def test_a_worker_of_some_of_its_nodes_gpus_asks_for_them_and_is_billed_its_share(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b, launcher = scripted_backends, scripted_backends.launcher
    spec = SPEC.model_validate(
        SPEC.model_dump(mode="json")
        | {
            "rollout": {"instance_type": "ecs.gn7i-4x.8xlarge", "gpus_per_worker": 2, "min_workers": 2},
            "training": {"instance_type": "ecs.gn7e-c16g1.32xlarge"},
        }
    )
    scheduler = Scheduler(b, settings)
    run_id = submit(b, spec)
    scheduler.tick()
    scheduler.tick()
    workers = launcher.running(run_id, "rollout")
    assert len(workers) == 2 and {launcher.gpus[w.name] for w in workers} == {2}  # two per 4-GPU node
    node = load_catalog().get("ecs.gn7i-4x.8xlarge")
    prices = {e.pod: e.price_per_hour for e in b.state.ledger(run_id)}
    assert [prices[w.name] for w in workers] == [pytest.approx(node.spot / 2)] * 2, "half a node each"


def test_a_scheduler_dead_between_opening_an_entry_and_launching_leaves_nothing_billed(
    scripted_backends: Backends, settings: Settings, submit, wait_for
) -> None:
    b, launcher = scripted_backends, scripted_backends.launcher
    run_id = submit(b, SPEC)
    first = Scheduler(b, settings)
    first.tick()
    launcher.error = _Died()
    with pytest.raises(_Died):
        first.tick()  # the entry of rollout-0 is open, the pod never launched, and the scheduler is gone
    (orphan,) = launcher.attempts
    assert b.state.open_ledger_count(run_id) == 1 and launcher.list(run_id) == []

    launcher.error = None
    successor = Scheduler(b, settings)  # takes over once the dead one's lease lapses
    wait_for(lambda: successor.tick() or launcher.running(run_id, "rollout"), message="the successor launched a worker")
    ((started, ended),) = entries(b, run_id)[orphan]
    assert ended == started, "closed with nothing billed"
    (worker,) = launcher.running(run_id, "rollout")
    assert worker.name != orphan
    assert b.state.open_ledger_count(run_id) == 1  # the running worker's only
    assert entries(b, run_id)[worker.name][0][1] is None


def test_a_pod_that_started_although_its_launch_raised_is_billed_from_its_start(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    run_id = submit(b, SPEC)
    scheduler.tick()
    launcher.error, launcher.started_anyway = TimeoutError("create timed out"), True  # ... yet the pod was created
    scheduler.tick()
    launcher.error = None
    (pod,) = launcher.running(run_id, "rollout")
    assert b.state.open_ledger_count(run_id) == 0
    scheduler.tick()  # the second safety net: a running pod without an open entry
    assert entries(b, run_id)[pod.name][-1] == (pod.started_at, None)


def test_an_ended_pod_is_billed_up_to_its_end_though_the_rest_of_its_tick_fails(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    """The ledger is matched first in a tick: a job observed ended has its entry closed at its end
    (and its outcome) even when a later action of the tick raises (here: it exited 0 without
    publishing, which fails the run), so the entry is not billed on up to now meanwhile."""
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    run_id = submit(b, SPEC)
    scheduler.tick()
    produce(b, run_id, 2)
    scheduler.tick()  # training job 1 launched
    launcher.end(job(b, 1).name, 0)  # ... and exits 0 without a result
    ended = job(b, 1)
    scheduler.tick()  # CloseEntry first, then RecordIteration raises PermanentError before ReapPod
    assert launcher.list(run_id) and job(b, 1) == ended, "not reaped: its tick failed before ReapPod"
    ((e,),) = [[e for e in b.state.ledger(run_id) if e.pod == ended.name]]
    assert (e.started_at <= ended.started_at, e.ended_at, e.outcome) == (True, ended.ended_at, "succeeded")
    assert b.state.get_run(run_id).status in (RunStatus.ENDING, RunStatus.FAILED)


def test_one_tick_publishes_a_bounded_chunk_of_a_huge_batch_and_reconciles_the_other_runs(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b = scripted_backends
    scheduler = Scheduler(b, settings)
    huge = submit(b, SPEC.model_copy(update={"batch_samples": 3 * 4 * MAX_PROMPTS_PER_TICK}))  # 3 ticks of prompts
    small = submit(b, SPEC)
    scheduler.tick()  # both started
    published = []
    for _ in range(4):
        scheduler.tick()
        published.append(sum(b.queue.end_offsets(prompts_topic(huge)).values()))
        # The other run was reconciled in the same tick: its prompts and its worker.
        assert sum(b.queue.end_offsets(prompts_topic(small)).values()) == 2
        assert b.launcher.running(small, "rollout")
    assert published == [
        MAX_PROMPTS_PER_TICK,
        2 * MAX_PROMPTS_PER_TICK,
        3 * MAX_PROMPTS_PER_TICK,
        3 * MAX_PROMPTS_PER_TICK,
    ]
    assert b.state.get_run(huge).prompts_published == 3 * MAX_PROMPTS_PER_TICK


def test_leftovers_at_the_end_are_dropped_a_bounded_chunk_per_tick(
    scripted_backends: Backends, settings: Settings, submit, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.control.scheduler import plan

    monkeypatch.setattr(plan, "MAX_LEFTOVERS_PER_TICK", 8)
    b = scripted_backends
    scheduler = Scheduler(b, settings)
    run_id = submit(b, SPEC.model_copy(update={"batch_samples": 400}))  # never trains: everything is left over
    scheduler.tick()
    produce(b, run_id, 5)  # 20 samples
    scheduler.tick()
    b.state.request_cancel(run_id)
    dropped = []
    for _ in range(8):
        scheduler.tick()
        dropped.append(b.state.get_run(run_id).samples_dropped)
    run = b.state.get_run(run_id)
    assert run.status == RunStatus.CANCELLED
    assert dropped[:5] == [0, 0, 8, 16, 20]  # stop the worker; reap it; then 8 a tick
    assert audit_run(b, run_id).problems == []


def test_recorded_iterations_rotate_the_stored_policy_versions(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    """Each recorded iteration deletes the policy versions (and trainer states) beyond the last
    `keep_policy_versions`; every version's result stays."""
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings.model_copy(update={"keep_policy_versions": 2}))
    run_id = submit(b, SPEC)
    scheduler.tick()
    produce(b, run_id, 8)
    stored = []
    for iteration in (1, 2, 3, 4):
        scheduler.tick()  # launches job `iteration`
        b.objects.put_bytes(f"runs/{run_id}/trainer/v{iteration}/value_head.pt", b"critic")
        publish(b, run_id, iteration, commit=True)
        launcher.end(job(b, iteration).name, 0)
        scheduler.tick()  # records it, and rotates
        stored.append(sorted({int(k.split("/")[3][1:]) for k in b.objects.list(f"runs/{run_id}/policy/")}))
    assert stored == [[1], [1, 2], [2, 3], [3, 4]]
    assert [b.objects.exists(f"runs/{run_id}/trainer/v{v}/value_head.pt") for v in (1, 2, 3, 4)] == [
        False,
        False,
        True,
        True,
    ]
    assert all(b.objects.exists(result_key(run_id, v)) for v in (1, 2, 3, 4))


@pytest.mark.parametrize("retention_s", [0.0, 86400.0])
def test_an_ended_runs_topics_are_deleted_after_the_retention(
    scripted_backends: Backends, settings: Settings, submit, retention_s: float
) -> None:
    from services.ports.queue.queue import UnknownTopicError

    b = scripted_backends
    scheduler = Scheduler(b, settings.model_copy(update={"queue_retention_s": retention_s}))
    run_id = submit(b, SPEC)
    scheduler.tick()  # started: its topics exist
    produce(b, run_id, 1)
    b.state.request_cancel(run_id)
    for _ in range(4):
        scheduler.tick()  # stops its pods, drops the leftovers, ends it; then the sweep
    assert b.state.get_run(run_id).status == RunStatus.CANCELLED
    expired = retention_s == 0.0
    assert b.state.get_run(run_id).queues_deleted == expired
    for topic in (prompts_topic(run_id), samples_topic(run_id)):
        if expired:
            with pytest.raises(UnknownTopicError):
                b.queue.end_offsets(topic)
        else:
            assert b.queue.end_offsets(topic)


def test_a_worker_waiting_for_a_node_is_not_billed_for_the_wait(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    """On Kubernetes a spot pod may wait for capacity long after its launch: the provider bills
    no machine meanwhile, so neither does the ledger (services.control.scheduler.ledger_match)."""
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    run_id = submit(b, SPEC)
    scheduler.tick()  # started
    # Worker 0 as the scheduler launched it an hour ago: its entry opened, then the pod created.
    name = rollout_pod_name(run_id, 0)
    b.state.update_run(run_id, worker_slots_used=1)
    b.state.open_ledger(
        run_id=run_id,
        role="rollout",
        pod=name,
        instance_type="g6.xlarge",
        capacity_type="spot",
        price_per_hour=0.35,
        price_source="test",
        started_at=time.time() - 3600,
    )
    launcher.launch(PodSpec(name, run_id, "rollout", ["worker"], {}, "g6.xlarge", "spot", {"slot": "0"}))
    launcher.pods[name] = dataclasses.replace(launcher.pods[name], waiting_for_node=True)  # no spot capacity yet
    scheduler.tick()
    ((started, ended),) = entries(b, run_id)[name]
    assert ended is None and started == pytest.approx(time.time() - NODE_BOOT_SECONDS, abs=5.0)


def test_a_batch_committed_while_the_scheduler_looks_is_counted_once(
    scripted_backends: Backends, settings: Settings, submit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job commits its batch between two of the scheduler's reads of the queue: what is queued
    and what the trainer committed are still of one moment, adding up to what was produced. (Read
    apart, the backlog still held the batch while the commits showed it gone: plan took it for
    the next batch too, and stopped a pool the run needed; a CI run relaunched both workers.)"""
    b = scripted_backends
    scheduler = Scheduler(b, settings)
    run_id = submit(b, SPEC)
    scheduler.tick()  # started: its topics exist
    produce(b, run_id, 4)  # two batches of two groups
    consumer = trainer_consumer(b.queue, run_id)
    records, offsets = take_batch(read_backlog(b.queue, consumer, run_id)[0], SPEC.batch_samples // 4)
    end_offsets = b.queue.end_offsets

    def end_offsets_then_the_job_commits(topic: str) -> dict[int, int]:
        seen = end_offsets(topic)
        if topic == samples_topic(run_id) and b.queue.committed(topic, TRAINER_GROUP) != offsets:
            consumer.commit(offsets)  # once: right after the scheduler's first read of the end offsets
        return seen

    monkeypatch.setattr(b.queue, "end_offsets", end_offsets_then_the_job_commits)
    observed = scheduler.observe(b.state.get_run(run_id), pods=[], spec=SPEC)
    consumer.close()
    assert b.queue.committed(samples_topic(run_id), TRAINER_GROUP) == offsets  # the job did commit meanwhile
    assert observed.samples_produced == 16
    assert observed.sample_backlog + 4 * observed.trainer_committed == observed.samples_produced


def test_the_deadline_rules_account_is_recorded_on_the_running_run(
    settings: Settings, scripted_backends: Backends, submit
) -> None:
    b = scripted_backends
    run_id = submit(b, SPEC.model_copy(update={"cost_policy": CostPolicy.COST_AWARE, "deadline_seconds": 36_000.0}))
    scheduler = Scheduler(b, settings)
    scheduler.tick()  # started
    scheduler.tick()  # the pool launched; no sample yet, so no pace to judge the deadline by
    assert b.state.get_run(run_id).status_reason == "waiting for spot capacity: no rate measured yet"
