"""Kubernetes launchers for the tests, on a namespace of the real test API server where the test's
kubelet and Job controller run the pods (tests/servers/kube.py, tests/servers/kubelet.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.ports.launcher.kubernetes_launcher import KubernetesLauncher
from services.ports.launcher.kubernetes_objects import KubernetesConfig
from tests.servers.kube import Cluster


def launcher_factory(cluster: Cluster, request: pytest.FixtureRequest) -> Callable[..., KubernetesLauncher]:
    """``open(**cfg)``: a new launcher (a restarted scheduler's) on the cluster's namespace, configured
    by ``cfg`` (KubernetesConfig's fields), closed after the test."""

    def open_launcher(*_: object, **cfg: Any) -> KubernetesLauncher:
        launcher = KubernetesLauncher(cluster.server.api_client(), KubernetesConfig(namespace=cluster.namespace, **cfg))
        request.addfinalizer(launcher.close)
        return launcher

    return open_launcher


def open_kubernetes_launcher(request: pytest.FixtureRequest) -> Callable[[Path], KubernetesLauncher]:
    return launcher_factory(request.getfixturevalue("kube_cluster"), request)
