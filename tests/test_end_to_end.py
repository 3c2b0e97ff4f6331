"""The whole loop on the embedded backends, through the real `spotrl serve` process and real pods.

Slow by nature (each pod is a Python process that imports torch): kept to the tiny model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.core.config import Settings
from services.domain.names import samples_topic
from services.ports.launcher.launcher import PodPhase
from services.ports.launcher.local_launcher import LocalLauncher
from services.ports.queue.sqlite_queue import SqliteQueue
from services.ports.wiring import open_backends
from services.tooling.run_audit import Audit, audit_run
from tests.servers.process import free_port

pytestmark = pytest.mark.slow


class Served:
    def __init__(self, home: Path, port: int) -> None:
        self.home = home
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def wait_for(self, run_id: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.client.get(f"/v1/runs/{run_id}").json()
            if run["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                return run
            time.sleep(0.1)  # a cheap read; the scheduler ticks every 0.2 s
        raise AssertionError(f"run {run_id} did not finish in {timeout_s} s: {run}")


@contextlib.contextmanager
def serving(tmp_path: Path, model_cache: Path, **env: str) -> Iterator[Served]:
    """A real `spotrl serve` on a free port with the tests' short timings (``env`` adds settings),
    stopped at the end, and no local pod of its left running."""
    port = free_port()
    home = tmp_path / "home"
    env = {
        **os.environ,
        "SPOTRL_HOME": str(home),
        "SPOTRL_MODEL_CACHE": str(model_cache),
        "SPOTRL_TICK_SECONDS": "0.2",
        "SPOTRL_SESSION_TIMEOUT_S": "3",
        "SPOTRL_STOP_GRACE_S": "10",
        "SPOTRL_POD_THREADS": "1",
        **env,
    }
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "serve", "--port", str(port)],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    s = Served(home, port)
    try:
        wait_until_ready(proc, s.client, log)
        yield s
    finally:
        stop_serving(proc, home)


def wait_until_ready(proc: subprocess.Popen, client: httpx.Client, log: Path) -> None:
    """Until `spotrl serve` answers /readyz (its log, should it exit first)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if client.get("/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "spotrl serve did not become ready"
        time.sleep(0.05)


def stop_serving(proc: subprocess.Popen, home: Path) -> None:
    """Stop `spotrl serve` (Ctrl-C), and SIGKILL any local pod of its still running."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    if (home / "pods").exists():  # the local launcher's
        for pod in LocalLauncher(home / "pods").list():
            if pod.phase == PodPhase.RUNNING and pod.pid:
                os.kill(pod.pid, signal.SIGKILL)


@pytest.fixture
def served(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path, tmp_path_factory.getbasetemp() / "models") as s:
        yield s


def tiny_spec(**changes) -> dict:
    spec = {
        "model": "tiny",
        "prompts": [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(12)],
        "samples_per_prompt": 4,
        "sampling": {"max_new_tokens": 8},
        "batch_samples": 16,
        "iterations": 2,
        "rollout": {"min_workers": 1, "max_workers": 2, "prompts_per_batch": 2},
        "training": {"learning_rate": 1e-3, "micro_batch": 8},
    }
    spec.update(changes)
    return spec


def assert_guarantees_held(home: Path, run: dict) -> Audit:
    """The run's audit (services.tooling.run_audit.audit_run) finds nothing wrong: every queued sample trained
    exactly once or counted as dropped, every committed prompt generated, no ledger entry open;
    and the API reports the counts the stores hold."""
    backends = open_backends(Settings(home=home))
    try:
        audit = audit_run(backends, run["id"])
    finally:
        backends.close()
    assert audit.problems == []
    assert run["samples"] == {
        "produced": audit.produced,
        "trained": audit.trained,
        "dropped": audit.dropped,
        "filtered": audit.filtered,
    }
    assert audit.prompts_committed > 0
    return audit


def test_run_end_to_end_over_http(served: Served) -> None:
    r = served.client.post("/v1/runs", json=tiny_spec())
    assert r.status_code == 201, r.text
    run = served.wait_for(r.json()["id"], timeout_s=240)
    assert run["status"] == "SUCCEEDED", run["status_reason"]
    assert len(run["iterations"]) >= 2
    assert run["policy_version"] == 2
    assert_guarantees_held(served.home, run)
    cost = served.client.get(f"/v1/runs/{run['id']}/cost").json()
    # standby: the warm training node the default cost-aware policy may hold between the two jobs
    assert {"rollout", "training"} <= set(cost["by_role"]) <= {"rollout", "training", "standby"}
    assert cost["by_capacity_type"]["spot"] > 0 and cost["by_capacity_type"]["on-demand"] > 0
    assert all(e["ended_at"] is not None for e in cost["entries"])
    # Every entry billed by its provider's rule, the total their sum; no saving is asserted (the
    # tiny model's jobs are shorter than AWS's 60 s minimum per launch: services/control/cost/billing.py).
    assert cost["total_dollars"] == pytest.approx(sum(e["dollars"] for e in cost["entries"]))
    assert cost["total_dollars"] >= cost["lower_bound_dollars"] > 0 and cost["always_on_dollars"] > 0
    metrics = served.client.get("/metrics").text
    assert f'spotrl_policy_version{{run="{run["id"]}"}} 2.0' in metrics

    # Ended pods are gone, their logs are kept: `spotrl logs` still shows the training job's.
    from typer.testing import CliRunner

    from services.cli.main import app

    shown = CliRunner().invoke(app, ["logs", f"{run['id']}-train-2", "--home", str(served.home)])
    assert shown.exit_code == 0, shown.output
    assert "iteration 2:" in shown.output


def test_killed_rollout_worker_loses_no_prompt(served: Served) -> None:
    spec = tiny_spec(
        rollout={"min_workers": 2, "max_workers": 2, "prompts_per_batch": 1}, iterations=2, batch_samples=24
    )
    run_id = served.client.post("/v1/runs", json=spec).json()["id"]
    launcher = LocalLauncher(served.home / "pods")
    queue = SqliteQueue(served.home / "queue.db")
    deadline = time.monotonic() + 120
    victim = None
    while victim is None:  # kill a worker as soon as samples flow, mid-run
        assert time.monotonic() < deadline, "no rollout worker produced samples"
        workers = [p for p in launcher.list(run_id) if p.role == "rollout" and p.phase == PodPhase.RUNNING and p.pid]
        if workers and sum(queue.end_offsets(samples_topic(run_id)).values()) > 0:
            victim = workers[0]
            os.kill(victim.pid, signal.SIGKILL)
        time.sleep(0.1)
    run = served.wait_for(run_id, timeout_s=240)
    assert run["status"] == "SUCCEEDED", run["status_reason"]
    cost = served.client.get(f"/v1/runs/{run_id}/cost").json()
    assert victim.name in [e["pod"] for e in cost["entries"]]
    assert len({e["pod"] for e in cost["entries"] if e["role"] == "rollout"}) >= 3, "the killed worker was replaced"

    assert_guarantees_held(served.home, run)  # no prompt lost among them
    queue.close()


def test_cancel_stops_pods_and_accounts_for_everything(served: Served) -> None:
    run_id = served.client.post("/v1/runs", json=tiny_spec(iterations=50)).json()["id"]
    deadline = time.monotonic() + 120
    while served.client.get(f"/v1/runs/{run_id}").json()["samples"]["produced"] == 0:
        assert time.monotonic() < deadline, "no samples were produced"
        time.sleep(0.2)
    assert served.client.post(f"/v1/runs/{run_id}/cancel").status_code == 200
    run = served.wait_for(run_id, timeout_s=60)
    assert run["status"] == "CANCELLED"
    assert LocalLauncher(served.home / "pods").list(run_id) == []
    assert served.client.post(f"/v1/runs/{run_id}/cancel").status_code == 409
    assert_guarantees_held(served.home, run)  # workers stopped by SIGTERM lost no prompt
