"""Held-out evals through the reconcile loop on the real embedded stores, the test playing the pods
(conftest.ScriptedLauncher): each chosen version's eval pod launched once (a restarted scheduler
too), billed, its result recorded; a failing one retried, then given up without failing the run."""

from __future__ import annotations

import time

from contracts.evaluation import EvalResult
from contracts.status import RunStatus
from services.control.scheduler.evals import EVAL_MAX_RETRIES
from services.control.scheduler.loop import Scheduler
from services.core.config import Settings
from services.domain.names import eval_pod_name, eval_result_key
from services.domain.runspec import RunSpec
from services.ports.wiring import Backends
from services.tooling.run_audit import audit_run
from tests.services.control.scheduler.test_accounting import SPEC, job, produce, publish

EVAL_SPEC = RunSpec.model_validate(
    {
        **SPEC.model_dump(mode="json"),
        "iterations": 2,
        "eval": {"prompts": [{"prompt": "2+2=", "answer": "4"}], "samples_per_prompt": 2},
    }
)


def write_result(b: Backends, run_id: str, version: int, mean: float) -> None:
    """What the eval pod of ``version`` writes last."""
    result = EvalResult(
        policy_version=version,
        mean_score=mean,
        metrics={"mean": mean},
        prompts=1,
        samples=2,
        seconds=1.0,
        ended_at=time.time(),
    )
    b.objects.put_bytes(eval_result_key(run_id, version), result.to_json())


def train(b: Backends, scheduler: Scheduler, run_id: str, iteration: int) -> None:
    """A batch queued, its job launched, published and ended, its iteration recorded."""
    produce(b, run_id, 2)
    scheduler.tick()
    publish(b, run_id, iteration, commit=True)
    b.launcher.end(job(b, iteration).name, 0)
    scheduler.tick()
    assert b.state.get_run(run_id).iterations_done == iteration


def test_each_version_is_evaluated_once_and_a_failing_eval_never_fails_the_run(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b, launcher = scripted_backends, scripted_backends.launcher
    scheduler = Scheduler(b, settings)
    run_id = submit(b, EVAL_SPEC)
    scheduler.tick()  # started
    scheduler.tick()  # a worker, and the base model's eval
    (pod,) = launcher.running(run_id, "eval")
    assert (pod.name, pod.instance_type, pod.capacity_type) == (eval_pod_name(run_id, 0), "g6.xlarge", "spot")
    assert [e.role for e in b.state.ledger(run_id) if e.pod == pod.name] == ["eval"]

    scheduler.leadership.release()  # the scheduler "dies"; a new one takes over from the stores
    scheduler = Scheduler(b, settings)
    scheduler.tick()
    assert launcher.attempts.count(eval_pod_name(run_id, 0)) == 1, "the eval of v0 was launched twice"
    write_result(b, run_id, 0, 0.25)
    launcher.end(pod.name, 0)
    scheduler.tick()
    assert [(e.policy_version, e.mean_score) for e in b.state.evals(run_id)] == [(0, 0.25)]

    train(b, scheduler, run_id, 1)
    scheduler.tick()  # the eval of v1 launches beside the next batch
    name = eval_pod_name(run_id, 1)
    launcher.end(name, 1)
    scheduler.tick()
    scheduler.tick()
    assert launcher.attempts.count(name) == 1, "retried before its delay"
    b.state.fail_eval(run_id, 1, failures=EVAL_MAX_RETRIES, retry_at=0.0)  # the clock moved on: its last retry is due
    scheduler.tick()
    launcher.end(name, 1)
    scheduler.tick()
    scheduler.tick()  # a clean tick keeps the reason on show
    run = b.state.get_run(run_id)
    assert launcher.attempts.count(name) == 2
    assert run.status == RunStatus.RUNNING and run.last_error.startswith(
        f"eval of policy v1 failed {EVAL_MAX_RETRIES + 1} times"
    )

    train(b, scheduler, run_id, 2)  # the run's last iteration: it ends, and evaluates v2 before it does
    for _ in range(3):
        scheduler.tick()
    assert b.state.get_run(run_id).status == RunStatus.ENDING
    write_result(b, run_id, 2, 0.75)
    launcher.end(eval_pod_name(run_id, 2), 0)
    for _ in range(4):
        scheduler.tick()
    run = b.state.get_run(run_id)
    assert run.status == RunStatus.SUCCEEDED, run.status_reason
    assert [(e.policy_version, e.mean_score) for e in b.state.evals(run_id)] == [(0, 0.25), (2, 0.75)]
    evals_billed = sorted(e.pod for e in b.state.ledger(run_id) if e.role == "eval")
    assert evals_billed == sorted([eval_pod_name(run_id, 0), name, name, eval_pod_name(run_id, 2)])
    assert audit_run(b, run_id).problems == []  # every entry closed, nothing left running
