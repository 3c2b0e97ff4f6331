"""`spotrl teardown`, what the chart's pre-delete hook runs before an uninstall, on a real API
server (tests/servers/kube.py): a run's pods and training Job, launched as the scheduler launches
them, are stopped and deleted, finalizers and all, and the run ends in the state store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes import client

from contracts.status import RunStatus
from services.core.config import Settings
from services.domain.names import eval_pod_name, rollout_pod_name, training_pod_name
from services.ports.launcher.launcher import PodSpec
from services.ports.state.state_store import StateStore
from tests.servers.kube import Cluster
from tests.services.ports.launcher.kube_support import launcher_factory
from tests.services.ports.launcher.test_launcher_contract import SLEEPS, wait_for_log, wait_until_ended

# Ends at once on SIGTERM, exit 0; and one that ignores it, so that only the deadline ends it.
GRACEFUL = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\nprint('ready', flush=True)\ntime.sleep(60)"
STUBBORN = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)"
)


def test_teardown_leaves_nothing_of_a_run_and_ends_it(
    kube_cluster: Cluster, settings: Settings, tmp_path: Path, request: pytest.FixtureRequest, wait_for
) -> None:
    launcher = launcher_factory(kube_cluster, request)()
    settings.home.mkdir(parents=True)
    state = StateStore(settings.resolved_state_url())  # the scheduler's store
    request.addfinalizer(state.close)
    run_id = "run-teardown"
    state.create_run(run_id, name=None, spec={})
    state.set_status(run_id, RunStatus.RUNNING)
    graceful, stubborn, evaluation, training = (
        rollout_pod_name(run_id, 0),
        rollout_pod_name(run_id, 1),
        eval_pod_name(run_id, 1),
        training_pod_name(run_id, 2),
    )
    specs = [
        PodSpec(graceful, run_id, "rollout", [sys.executable, "-c", GRACEFUL], {}, "g5.xlarge", "spot", {"slot": "0"}),
        PodSpec(stubborn, run_id, "rollout", [sys.executable, "-c", STUBBORN], {}, "g5.xlarge", "spot", {"slot": "1"}),
        PodSpec(
            evaluation,
            run_id,
            "eval",
            [sys.executable, "-c", "print('evaluated')"],
            {},
            "g5.xlarge",
            "spot",
            {"version": "1"},
        ),
        PodSpec(
            training,
            run_id,
            "training",
            [sys.executable, "-c", SLEEPS],
            {},
            "p4d.24xlarge",
            "on-demand",
            {"iteration": "2"},
        ),
    ]
    for spec in specs:  # launched and billed, as the scheduler does
        launcher.launch(spec)
        state.open_ledger(
            run_id=run_id,
            role=spec.role,
            pod=spec.name,
            instance_type=spec.instance_type,
            capacity_type=spec.capacity_type,
            price_per_hour=1.0,
            price_source="test",
            started_at=time.time(),
        )
    for name in (graceful, stubborn, training):
        wait_for_log(launcher, name, "ready")
    wait_until_ended(launcher, evaluation)  # ended: its finalizer holds it for the scheduler to read

    # As the hook runs it: the scheduler's settings; the stubborn pod's grace outlasts the deadline.
    env = {
        **os.environ,
        **settings.pod_env(),
        "SPOTRL_LAUNCHER": "kubernetes",
        "SPOTRL_KUBE_CONFIG": str(kube_cluster.server.kubeconfig),
        "SPOTRL_KUBE_NAMESPACE": kube_cluster.namespace,
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "teardown", "--grace-s", "30", "--timeout-s", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr

    # Nothing is left in the namespace, not a pod (so no finalizer) nor a Job, as the server has it.
    with kube_cluster.server.api_client() as api:
        pods = json.loads(
            client.CoreV1Api(api).list_namespaced_pod(kube_cluster.namespace, _preload_content=False).data
        )
        jobs = json.loads(
            client.BatchV1Api(api).list_namespaced_job(kube_cluster.namespace, _preload_content=False).data
        )
    assert (pods["items"], jobs["items"]) == ([], [])
    wait_for(
        lambda: all(p.popen.poll() is not None for p in kube_cluster.kubelet.processes.values()),
        message="every pod's process has ended",
    )
    # The run ended; each pod is billed to its end, as it ended: the graceful one stopped by SIGTERM,
    # the training job killed by it, the stubborn one deleted at the deadline.
    assert state.get_run(run_id).status == RunStatus.CANCELLED.value
    ledger = state.ledger(run_id)
    assert {e.pod: e.outcome for e in ledger} == {
        graceful: "succeeded",
        stubborn: "killed",
        evaluation: "succeeded",
        training: "killed",
    }
    assert all(e.ended_at is not None for e in ledger)
    assert f"runs ended: {run_id}" in done.stdout
