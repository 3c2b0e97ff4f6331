"""Chaos during a real run: the tiny model, real pods, the scheduler as its own process, and
``services.tooling.chaos.Chaos`` SIGKILLing rollout workers, a training job between publishing and
committing, and the scheduler (restarted each time), and preempting spot training jobs mid-update
(with the provider's notice and without). Then ``audit_run``, the same audit as
`spotrl demo --chaos`, must find every guarantee kept.

Slow by nature (each pod is a Python process that imports torch): kept to the tiny model and
five short iterations (two preempted, then three chances to catch a job between publishing and committing).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from services.core.config import Settings
from services.domain.names import pod_log_key
from services.ports.launcher.launcher import PodPhase
from services.ports.wiring import open_backends
from services.tooling.chaos import Chaos
from services.tooling.chaos_plan import ChaosPlan, ChaosTally
from services.tooling.run_audit import audit_run

pytestmark = pytest.mark.slow

SPEC = {
    "model": "tiny",
    "prompts": [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)],
    "samples_per_prompt": 4,
    "sampling": {"max_new_tokens": 8},
    "batch_samples": 16,
    "iterations": 5,
    "rollout": {"min_workers": 2, "max_workers": 2, "prompts_per_batch": 2},
    # On spot: two optimizer steps an update (mini-batches of 8), checkpointed at a notice.
    "training": {"learning_rate": 1e-3, "micro_batch": 8, "mini_batch": 8, "capacity": "spot"},
}
PLAN = ChaosPlan(worker_kills=2, training_kills=1, training_preemptions=2, scheduler_restarts=2, pause_s=2.5)


async def test_a_run_under_chaos_loses_nothing_trains_nothing_twice_and_bills_everything(
    api: httpx.AsyncClient, settings: Settings, tmp_path: Path
) -> None:
    response = await api.post("/v1/runs", json=SPEC)
    assert response.status_code == 201, response.text
    run_id = response.json()["id"]
    backends = open_backends(settings)
    try:

        def under_chaos() -> tuple[ChaosTally, bool]:
            with Chaos(settings, backends, run_id, PLAN, log_dir=tmp_path / "chaos") as chaos:
                ended = chaos.wait(timeout_s=240)
            return chaos.tally, ended

        tally, ended = await asyncio.to_thread(under_chaos)
        assert ended, f"the run did not end: {backends.state.get_run(run_id).status}; {tally.line()}"
        audit = audit_run(backends, run_id)
        print(tally.line(), *audit.lines(), sep="\n")  # shown with -s, and on failure
        trainer_keys = backends.objects.list(f"runs/{run_id}/trainer/")
        ledger = backends.state.ledger(run_id)
        job_logs = {
            int(e.pod.rsplit("-", 1)[1]): backends.objects.get_bytes(pod_log_key(run_id, e.pod)).decode()
            for e in ledger
            if e.role == "training"
        }
    finally:
        for pod in backends.launcher.list():  # nothing of ours is left running
            if pod.phase == PodPhase.RUNNING and pod.pid:
                os.kill(pod.pid, signal.SIGKILL)
        backends.close()

    assert audit.problems == []
    assert audit.status == "SUCCEEDED"
    assert audit.policy_versions == [1, 2, 3, 4, 5] and audit.policy_version == 5
    assert audit.produced == audit.trained + audit.dropped  # audited by id above; the totals, for the reader
    # Each kind of disruption happened, for real.
    assert len(tally.training_kills) == 1, tally.line()
    assert len(tally.worker_kills) >= 1, tally.line()
    assert tally.scheduler_kills >= 1 and tally.scheduler_starts >= 2, tally.line()
    # Two spot training jobs were preempted mid-update, one at a notice and one without; each was
    # billed up to its preemption and its iteration started again, unpenalised.
    assert [how for _, how in tally.training_preemptions] == ["notice", "no notice"], tally.line()
    # (Spot jobs SIGKILLed between publishing and committing, of other iterations, read as reclaimed
    # too: those that had committed first, the missed ones, as well.)
    preempted = [int(e.pod.rsplit("-", 1)[1]) for e in ledger if e.role == "training" and e.outcome == "preempted"]
    assert {i for i, _ in tally.training_preemptions} | set(tally.training_kills) <= set(preempted)
    assert len(preempted) <= len(tally.training_preemptions) + len(tally.training_kills) + tally.training_missed
    assert all(e.capacity_type == "spot" for e in ledger if e.role == "training")
    # Each preempted iteration's last job trained the batch its predecessor stored (from its
    # checkpoint's step where the notice came after one), not a new one from the queue.
    for iteration, _ in tally.training_preemptions:
        log = job_logs[iteration]
        assert "resuming the update after step" in log or "training the batch an earlier job took" in log, log
    # A killed job's clean-up (its predecessor's optimizer state) is done by the next job: at most the last two remain.
    optimizer_versions = {int(m.group(1)) for k in trainer_keys if (m := re.search(r"/v(\d+)/optimizer", k))}
    assert optimizer_versions <= {4, 5}, optimizer_versions
