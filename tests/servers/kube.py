"""A real Kubernetes API server (kube-apiserver v1.20.2 + etcd) for the Kubernetes launcher's tests.

The "envtest" way: a control plane without nodes, kubelets or controllers, so a test plays the
kubelet and the Job controller itself (creates pods, patches their status). kube-apiserver is
built once per machine from Debian 12's source package by ``scripts/build-kube-apiserver.sh``
(`make test` runs it), cached at ``~/.cache/spotrl/kube-apiserver-v1.20.2``;
``SPOTRL_TEST_KUBE_APISERVER`` names another binary. etcd is Debian's ``etcd-server``.

Started on first use, on free loopback ports: etcd with its data on /dev/shm (etcd 3.4 has no
no-fsync flag; memory makes its fsyncs free), then kube-apiserver with a static bearer token in
``system:masters``, AlwaysAllow authorization, a service-account key pair made with openssl, and
a self-signed serving certificate it writes itself, used as the CA once /readyz answers, and
no watch cache: watches are served from etcd, so that a test makes a resourceVersion too old
(410 Gone) by compacting etcd (``KubeServer.compact()``), where the cache would keep it for at
least 75 s. Both are stopped by their PIDs when the session ends. ../shared/TEST-INFRA.md has what v1.20 lacks.

Fixtures:
- ``kube``: the session's server (``KubeServer``: ``api_client()``, ``kubeconfig``).
- ``kube_namespace``: a fresh namespace per test. No namespace controller runs, so a deleted one
  would stay Terminating forever: each test gets a new one instead, and the server goes at the end.
- ``kube_cluster``: a fresh namespace whose pods run (``Cluster``: the test's kubelet and Job
  controller on it, stopped with their processes at the end of the test).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kubernetes import client

from tests.servers.kubelet import JobController, Kubelet
from tests.servers.process import free_port

VERSION = "v1.20.2"
READY_TIMEOUT_S = 90.0  # bounds a hang only: ready in about 5 s on an idle machine
BUILD_SCRIPT = "scripts/build-kube-apiserver.sh"


def apiserver_binary() -> Path:
    if os.environ.get("SPOTRL_TEST_KUBE_APISERVER"):
        return Path(os.environ["SPOTRL_TEST_KUBE_APISERVER"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "spotrl" / f"kube-apiserver-{VERSION}"


@dataclass
class KubeServer:
    host: str  # https://127.0.0.1:<port>
    token: str = field(repr=False)
    ca_file: Path
    kubeconfig: Path  # a kubeconfig for this server, as a user's or the launcher's config would be
    etcd_url: str  # its etcd's client URL (http://127.0.0.1:<port>)
    _names: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def configuration(self) -> client.Configuration:
        config = client.Configuration(
            host=self.host, api_key={"authorization": self.token}, api_key_prefix={"authorization": "Bearer"}
        )
        config.ssl_ca_cert = str(self.ca_file)
        return config

    def api_client(self) -> client.ApiClient:
        return client.ApiClient(self.configuration())

    def compact(self) -> None:
        """Compact etcd's history up to now: every older resourceVersion is gone (410 on a watch from it)."""
        with urllib.request.urlopen(
            urllib.request.Request(
                f"{self.etcd_url}/v3/kv/range", method="POST", data=json.dumps({"key": "AA=="}).encode()
            )
        ) as answer:
            revision = json.loads(answer.read())["header"]["revision"]
        urllib.request.urlopen(
            urllib.request.Request(
                f"{self.etcd_url}/v3/kv/compaction", method="POST", data=json.dumps({"revision": revision}).encode()
            )
        ).close()

    def new_namespace(self) -> str:
        name = f"test-{os.getpid()}-{next(self._names)}"
        with self.api_client() as api:
            client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        return name


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _wait_ready(
    url: str,
    what: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    context: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}; its log:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers or {}), timeout=5, context=context
            ) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(
                f"{what} not ready within {READY_TIMEOUT_S} s; its log:\n{log.read_text(errors='replace')[-4000:]}"
            )
        time.sleep(0.1)


def _kubeconfig(path: Path, host: str, ca_file: Path, token: str) -> None:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {{server: "{host}", certificate-authority: "{ca_file}"}}
users:
- name: test
  user: {{token: "{token}"}}
contexts:
- name: test
  context: {{cluster: test, user: test}}
current-context: test
""")


@pytest.fixture(scope="session")
def kube() -> Iterator[KubeServer]:
    binary = apiserver_binary()
    if not os.access(binary, os.X_OK):
        pytest.fail(f"no kube-apiserver at {binary}: run {BUILD_SCRIPT} once (make test does; 5-16 min)")
    etcd_binary = shutil.which("etcd")
    if etcd_binary is None:
        pytest.fail(
            f"no etcd on PATH: run {BUILD_SCRIPT} (it installs Debian's etcd-server) or apt-get install etcd-server"
        )
    workdir = Path(tempfile.mkdtemp(prefix="spotrl-kube-"))
    etcd_data = Path(tempfile.mkdtemp(prefix="spotrl-etcd-", dir="/dev/shm"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        etcd_port, peer_port = free_port(), free_port()
        etcd_log = workdir / "etcd.log"
        with etcd_log.open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        etcd_binary,
                        "--name",
                        "test",
                        "--data-dir",
                        str(etcd_data),
                        "--listen-client-urls",
                        f"http://127.0.0.1:{etcd_port}",
                        "--advertise-client-urls",
                        f"http://127.0.0.1:{etcd_port}",
                        "--listen-peer-urls",
                        f"http://127.0.0.1:{peer_port}",
                        "--initial-advertise-peer-urls",
                        f"http://127.0.0.1:{peer_port}",
                        "--initial-cluster",
                        f"test=http://127.0.0.1:{peer_port}",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        _wait_ready(f"http://127.0.0.1:{etcd_port}/health", "etcd", procs[0], etcd_log)

        token = secrets.token_urlsafe(24)
        (workdir / "tokens.csv").write_text(f'{token},spotrl-test,spotrl-test,"system:masters"\n')
        _openssl("genrsa", "-out", str(workdir / "sa.key"), "2048")
        _openssl("rsa", "-in", str(workdir / "sa.key"), "-pubout", "-out", str(workdir / "sa.pub"))
        port = free_port()
        certs = workdir / "certs"
        apiserver_log = workdir / "kube-apiserver.log"
        with apiserver_log.open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        str(binary),
                        "--etcd-servers",
                        f"http://127.0.0.1:{etcd_port}",
                        "--bind-address",
                        "127.0.0.1",
                        "--secure-port",
                        str(port),
                        "--insecure-port",
                        "0",
                        "--cert-dir",
                        str(certs),
                        "--token-auth-file",
                        str(workdir / "tokens.csv"),
                        "--authorization-mode",
                        "AlwaysAllow",
                        "--service-account-issuer",
                        "https://kubernetes.default.svc",
                        "--service-account-key-file",
                        str(workdir / "sa.pub"),
                        "--service-account-signing-key-file",
                        str(workdir / "sa.key"),
                        "--service-cluster-ip-range",
                        "10.96.0.0/24",
                        "--disable-admission-plugins",
                        "ServiceAccount",
                        "--watch-cache=false",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        host = f"https://127.0.0.1:{port}"
        # Not verified until it answers: the certificate it will serve does not exist before it starts.
        unverified = ssl._create_unverified_context()
        _wait_ready(
            f"{host}/readyz",
            "kube-apiserver",
            procs[1],
            apiserver_log,
            unverified,
            {"Authorization": f"Bearer {token}"},
        )
        ca_file = certs / "apiserver.crt"
        _kubeconfig(workdir / "kubeconfig", host, ca_file, token)
        yield KubeServer(
            host=host,
            token=token,
            ca_file=ca_file,
            kubeconfig=workdir / "kubeconfig",
            etcd_url=f"http://127.0.0.1:{etcd_port}",
        )
    finally:
        # The API server's graceful shutdown waits out open watches: nothing here is worth the wait.
        for proc in reversed(procs):
            proc.kill()
            proc.wait()
        shutil.rmtree(etcd_data, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def kube_namespace(kube: KubeServer) -> str:
    """A namespace of the test's own (never deleted: see the module docstring)."""
    return kube.new_namespace()


@dataclass
class Cluster:
    """A namespace whose pods run: the test's kubelet and Job controller (tests/servers/kubelet.py) on it."""

    server: KubeServer
    namespace: str
    kubelet: Kubelet
    jobs: JobController


@pytest.fixture
def kube_cluster(kube: KubeServer, kube_namespace: str) -> Iterator[Cluster]:
    api = kube.api_client()
    kubelet = Kubelet(api, kube_namespace)
    jobs = JobController(api, kube_namespace)
    try:
        yield Cluster(kube, kube_namespace, kubelet, jobs)
    finally:
        jobs.stop()
        kubelet.stop()
        api.close()
