"""A whole run on the Kubernetes launcher: `spotrl serve` with ``SPOTRL_LAUNCHER=kubernetes`` on
the real test API server, its rollout pods and training Jobs run by the test's kubelet and Job
controller as local processes (tests/servers/kubelet.py). The tiny model, as in
tests/test_end_to_end.py, whose helpers this reuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.ports.launcher.kubernetes_launcher import KubernetesLauncher
from services.ports.launcher.kubernetes_objects import KubernetesConfig
from tests.servers.kube import Cluster
from tests.test_end_to_end import Served, assert_guarantees_held, serving, tiny_spec

pytestmark = pytest.mark.slow


@pytest.fixture
def served_on_kubernetes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, kube_cluster: Cluster
) -> Iterator[Served]:
    with serving(
        tmp_path,
        tmp_path_factory.getbasetemp() / "models",
        SPOTRL_LAUNCHER="kubernetes",
        SPOTRL_KUBE_CONFIG=str(kube_cluster.server.kubeconfig),
        SPOTRL_KUBE_NAMESPACE=kube_cluster.namespace,
    ) as s:
        yield s


def test_a_run_on_the_kubernetes_launcher(served_on_kubernetes: Served, kube_cluster: Cluster) -> None:
    spec = tiny_spec(iterations=1, rollout={"min_workers": 1, "max_workers": 1, "prompts_per_batch": 2})
    r = served_on_kubernetes.client.post("/v1/runs", json=spec)
    assert r.status_code == 201, r.text
    run = served_on_kubernetes.wait_for(r.json()["id"], timeout_s=240)

    assert run["status"] == "SUCCEEDED", run["status_reason"]
    assert run["policy_version"] == 1
    assert_guarantees_held(served_on_kubernetes.home, run)
    cost = served_on_kubernetes.client.get(f"/v1/runs/{run['id']}/cost").json()
    assert cost["by_capacity_type"]["spot"] > 0 and cost["by_capacity_type"]["on-demand"] > 0
    # Every pod ran through the API server (the kubelet ran them) and was reaped from it.
    assert len(kube_cluster.kubelet.processes) >= 2
    launcher = KubernetesLauncher(kube_cluster.server.api_client(), KubernetesConfig(namespace=kube_cluster.namespace))
    try:
        assert launcher.list() == []
    finally:
        launcher.close()
