"""The test's stand-ins for the parts of Kubernetes that the test API server does not run.

``Kubelet`` plays the scheduler and the kubelet for one namespace: it puts each new pod on a
node that fits what the pod asks (a Node object it creates, labelled with the instance type
and the capacity type), binds the pod there, runs the pod's command as a local process, and
reports it through the pod's status subresource the way a kubelet does (phase, start time,
the container's state and exit code, 128+n for a signal death), its environment with the
``envFrom`` Secrets' and ConfigMaps' variables. A pod being deleted gets
SIGTERM and, once its grace period is over, SIGKILL; once ended it is deleted for good (unless a
finalizer holds it). The pod log API works: the API server asks this kubelet's HTTPS endpoint
(``/containerLogs/...``), which answers from the process's output.

``spot_capacity`` (an Event, set) is the zone's spot capacity: cleared, pods that ask for spot
stay Pending with no node, as when the cloud has none to give.

``JobController`` plays the Job controller: one pod at a time per Job from its template (one
per index of a Job of several ``completions``, annotated with its index and named by its host
``<job>-<index>``, as for an Indexed Job: v1.20 drops ``completionMode``, and the launcher writes
no other Job of several), the Job's status from the pods' ends, and the Job's
``podFailurePolicy`` rules on pod conditions (``Ignore``: a new pod, uncounted; ``FailJob``: the
Job fails; ``Count``, and a failure no rule matches: counted against ``backoffLimit``); a failed
Job's running pods are deleted. v1.20 drops the policy from the Job it stores, so the policy
applied is the one the launcher writes for the capacity type and nodes the Job's spec annotation
names (``pod_failure_policy``). The kubelet gives a pod's ``env`` fields of the pod
(``valueFrom.fieldRef``: its annotations, its IP) as a kubelet does.

Both poll the namespace every ``POLL_S``: simpler than watches, and the launcher's own watches
are what the tests are about.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from services.ports.launcher.kubernetes_objects import INDEX_ANNOTATION, SPEC_ANNOTATION, pod_failure_policy
from tests.servers.process import free_port

POLL_S = 0.05
SPOT_LABEL = "karpenter.sh/capacity-type"


def now_stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read(response: Any) -> dict[str, Any]:
    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


def done(response: Any) -> None:
    """Back to the pool once read to its end: a connection with an answer unread would hand its
    rest to the next request on it."""
    response.drain_conn()
    response.release_conn()


@dataclass
class _Process:
    popen: subprocess.Popen[bytes]
    log: Path
    started: str
    kill_at: float | None = None  # set once the pod is being deleted


class Kubelet:
    """Runs the namespace's pods as local processes (module docstring). ``python`` in a command
    is this interpreter (the launcher runs the image's ``python``)."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.dir = Path(tempfile.mkdtemp(prefix=f"spotrl-kubelet-{namespace}-"))
        self.processes: dict[str, _Process] = {}  # pod uid -> its process
        self._ended: set[str] = set()  # uids reported ended
        # Cleared, the zone has no spot capacity: a pod that asks for spot waits unbound, no node
        # is made for it, until it is set again (or the pod is deleted).
        self.spot_capacity = threading.Event()
        self.spot_capacity.set()
        self._stop = threading.Event()
        self._logs = self._serve_logs()
        self._thread = threading.Thread(
            target=_sync_until_stopped,
            args=(self.sync, self._stop, "kubelet"),
            name=f"kubelet-{namespace}",
            daemon=True,
        )
        self._thread.start()

    # --- the nodes and the log endpoint ---
    @staticmethod
    def wants_spot(pod: dict[str, Any]) -> bool:
        terms = (
            pod["spec"]
            .get("affinity", {})
            .get("nodeAffinity", {})
            .get("requiredDuringSchedulingIgnoredDuringExecution", {})
            .get("nodeSelectorTerms", [])
        )
        return any(e["operator"] == "In" and e["key"] == SPOT_LABEL for t in terms for e in t["matchExpressions"])

    def node_for(self, pod: dict[str, Any]) -> str:
        """A node fitting the pod's node selector and capacity affinity, created if need be."""
        selector = pod["spec"].get("nodeSelector") or {}
        labels = {**selector, SPOT_LABEL: "spot" if self.wants_spot(pod) else "on-demand"}
        name = f"{self.namespace}-{labels.get('node.kubernetes.io/instance-type', 'any')}-{labels[SPOT_LABEL]}"
        name = name.replace(".", "-")
        try:
            done(
                self.core.create_node(
                    {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}},
                    _preload_content=False,
                )
            )
        except ApiException as e:
            if e.status != 409:
                raise
            return name
        done(
            self.core.patch_node_status(
                name,
                {
                    "status": {
                        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                        "daemonEndpoints": {"kubeletEndpoint": {"Port": self._logs.server_port}},
                        "conditions": [
                            {
                                "type": "Ready",
                                "status": "True",
                                "reason": "KubeletReady",
                                "lastHeartbeatTime": now_stamp(),
                                "lastTransitionTime": now_stamp(),
                            }
                        ],
                    }
                },
                _preload_content=False,
            )
        )
        return name

    def _serve_logs(self) -> http.server.ThreadingHTTPServer:
        """The kubelet's log endpoint, over HTTPS with a self-signed certificate (the API server
        does not verify kubelets' certificates unless told to)."""
        key, cert = self.dir / "kubelet.key", self.dir / "kubelet.crt"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
            ],
            check=True,
            capture_output=True,
        )
        kubelet = self

        class Logs(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                parts = url.path.strip("/").split("/")  # containerLogs/<namespace>/<pod>/<container>
                path = kubelet.dir / f"{parts[2]}.log" if len(parts) == 4 and parts[0] == "containerLogs" else None
                if path is None or not path.exists():
                    self.send_error(404)
                    return
                lines = path.read_bytes().splitlines(keepends=True)
                tail = urllib.parse.parse_qs(url.query).get("tailLines")
                body = b"".join(lines[-int(tail[0]) :] if tail and int(tail[0]) > 0 else [] if tail else lines)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Logs)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    # --- the loop ---
    def sync(self) -> None:
        pods = read(self.core.list_namespaced_pod(self.namespace, _preload_content=False))["items"]
        present = {p["metadata"]["uid"] for p in pods}
        for uid, proc in self.processes.items():
            if uid not in present and proc.popen.poll() is None:  # deleted for good: killed at once
                os.killpg(proc.popen.pid, signal.SIGKILL)
        for pod in pods:
            uid = pod["metadata"]["uid"]
            if uid in self._ended:
                if pod["metadata"].get("deletionTimestamp") and pod["metadata"].get("deletionGracePeriodSeconds") != 0:
                    self._delete_for_good(pod)
                continue
            if uid not in self.processes:
                if pod["metadata"].get("deletionTimestamp"):
                    continue  # deleted before it started
                if self.wants_spot(pod) and not self.spot_capacity.is_set():
                    continue  # no node for it yet
                self._start(pod)
                continue
            proc = self.processes[uid]
            if pod["metadata"].get("deletionTimestamp") and proc.popen.poll() is None:
                kill_at = time.time() + (pod["metadata"].get("deletionGracePeriodSeconds") or 0)
                if proc.kill_at is None:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                proc.kill_at = kill_at if proc.kill_at is None else min(proc.kill_at, kill_at)
            if proc.kill_at is not None and time.time() >= proc.kill_at and proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            code = proc.popen.poll()
            if code is not None:
                self._report_end(pod, proc, code)

    def _start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        node = self.node_for(pod)
        done(
            self.core.create_namespaced_pod_binding(
                name,
                self.namespace,
                {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": name},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                },
                _preload_content=False,
            )
        )
        container = pod["spec"]["containers"][0]
        command = [sys.executable if word == "python" else word for word in container["command"][:1]]
        command += container["command"][1:]
        env = {
            **os.environ,
            **self._env_from(container),
            **{e["name"]: _value(pod, e) for e in container.get("env", [])},
        }
        log = self.dir / f"{name}.log"
        started = now_stamp()
        with log.open("wb") as out:
            popen = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.processes[pod["metadata"]["uid"]] = _Process(popen, log, started)
        self._patch_status(name, "Running", {"running": {"startedAt": started}}, started, ready=True)

    def _env_from(self, container: dict[str, Any]) -> dict[str, str]:
        """The variables of the container's ``envFrom`` Secrets and ConfigMaps, as a kubelet reads them
        (``env`` overrides them)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                data = read(
                    self.core.read_namespaced_secret(
                        source["secretRef"]["name"], self.namespace, _preload_content=False
                    )
                ).get("data", {})
                env |= {k: base64.b64decode(v).decode() for k, v in data.items()}
            else:
                env |= read(
                    self.core.read_namespaced_config_map(
                        source["configMapRef"]["name"], self.namespace, _preload_content=False
                    )
                ).get("data", {})
        return env

    def _report_end(self, pod: dict[str, Any], proc: _Process, code: int) -> None:
        exit_code = 128 - code if code < 0 else code  # as container runtimes report a signal death
        terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": proc.started,
            "finishedAt": now_stamp(),
        }
        self._patch_status(
            pod["metadata"]["name"],
            "Succeeded" if code == 0 else "Failed",
            {"terminated": terminated},
            proc.started,
            ready=False,
        )
        self._ended.add(pod["metadata"]["uid"])
        if pod["metadata"].get("deletionTimestamp"):
            self._delete_for_good(pod)

    def _delete_for_good(self, pod: dict[str, Any]) -> None:
        """What a kubelet does once a deleted pod's containers have ended (a finalizer may hold it still)."""
        try:
            done(
                self.core.delete_namespaced_pod(
                    pod["metadata"]["name"], self.namespace, grace_period_seconds=0, _preload_content=False
                )
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def _patch_status(self, name: str, phase: str, state: dict[str, Any], started: str, ready: bool) -> None:
        status = {
            "phase": phase,
            "startTime": started,
            "hostIP": "127.0.0.1",
            "containerStatuses": [
                {"name": "main", "ready": ready, "restartCount": 0, "image": "spotrl", "imageID": "", "state": state}
            ],
        }
        try:
            done(
                self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status}, _preload_content=False)
            )
        except ApiException as e:
            if e.status != 404:  # deleted meanwhile
                raise

    def preempt(self, name: str, grace_s: int = 2) -> None:
        """A spot interruption as a current cluster carries it out: the DisruptionTarget
        condition on the pod, then its deletion with a grace period."""
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "TerminationByKubelet",
            "message": "spot instance interrupted",
            "lastTransitionTime": now_stamp(),
        }
        done(
            self.core.patch_namespaced_pod_status(
                name, self.namespace, {"status": {"conditions": [condition]}}, _preload_content=False
            )
        )
        done(
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace_s, _preload_content=False)
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for proc in self.processes.values():
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()
        self._logs.shutdown()
        self._logs.server_close()


class JobController:
    """Creates the pods of the namespace's Jobs and keeps the Jobs' status (module docstring)."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.namespace = namespace
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_sync_until_stopped,
            args=(self.sync, self._stop, "job controller"),
            name=f"job-controller-{namespace}",
            daemon=True,
        )
        self._thread.start()

    def sync(self) -> None:
        jobs = read(self.batch.list_namespaced_job(self.namespace, _preload_content=False))["items"]
        pods = read(self.core.list_namespaced_pod(self.namespace, _preload_content=False))["items"]
        for job in jobs:
            conditions = {c["type"] for c in job.get("status", {}).get("conditions") or []}
            if conditions & {"Complete", "Failed"} or job["metadata"].get("deletionTimestamp"):
                continue
            mine = [p for p in pods if p["metadata"].get("labels", {}).get("controller-uid") == job["metadata"]["uid"]]
            active = [p for p in mine if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
            succeeded = [p for p in mine if p.get("status", {}).get("phase") == "Succeeded"]
            completions = job["spec"].get("completions", 1)
            done_indices = {_index(p) for p in succeeded}
            policy = self.pod_failure_policy(job)
            actions = [self._action(policy, p) for p in mine if p.get("status", {}).get("phase") == "Failed"]
            failed = [a for a in actions if a != "Ignore"]
            status: dict[str, Any] = {
                "active": len(active),
                "succeeded": len(succeeded),
                "failed": len(failed),
                "startTime": job.get("status", {}).get("startTime") or now_stamp(),
            }
            if len(done_indices) == completions:
                status |= {"completionTime": now_stamp(), "conditions": [self._condition("Complete", "")]}
            elif "FailJob" in actions:
                status["conditions"] = [self._condition("Failed", "PodFailurePolicy")]
                self._terminate(active)
            elif len(failed) > job["spec"]["backoffLimit"]:
                status["conditions"] = [self._condition("Failed", "BackoffLimitExceeded")]
                self._terminate(active)
            elif job["spec"].get("parallelism", 1) > 0:
                running = {_index(p) for p in active}
                for index in range(completions) if completions > 1 else [None]:
                    if index not in done_indices | running:
                        self._create_pod(job, index)
                        status["active"] += 1
            if status != {k: job.get("status", {}).get(k) for k in status}:
                done(
                    self.batch.patch_namespaced_job_status(
                        job["metadata"]["name"], self.namespace, {"status": status}, _preload_content=False
                    )
                )

    @staticmethod
    def pod_failure_policy(job: dict[str, Any]) -> dict[str, Any]:
        """The Job's own policy where the server kept it (1.25 and later), else the launcher's for its
        spec's capacity type; a Job the launcher did not write has none."""
        if "podFailurePolicy" in job["spec"]:
            return job["spec"]["podFailurePolicy"]
        described = job["metadata"].get("annotations", {}).get(SPEC_ANNOTATION)
        if not described:
            return {"rules": []}
        spec = json.loads(described)
        return pod_failure_policy(spec["capacity_type"] == "spot" or spec.get("nodes", 1) > 1)

    @staticmethod
    def _action(policy: dict[str, Any], pod: dict[str, Any]) -> str:
        """The action of the first rule whose pod conditions the failed pod has, else ``Count``."""
        conditions = {(c["type"], c.get("status")) for c in pod["status"].get("conditions") or []}
        for rule in policy["rules"]:
            if any((c["type"], c.get("status", "True")) in conditions for c in rule.get("onPodConditions", [])):
                return rule["action"]
        return "Count"

    @staticmethod
    def _condition(kind: str, reason: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": "True",
            "reason": reason,
            "lastProbeTime": now_stamp(),
            "lastTransitionTime": now_stamp(),
        }

    def _terminate(self, active: list[dict[str, Any]]) -> None:
        """What the Job controller does to the pods still running when their Job fails: delete them,
        with their grace period."""
        for pod in active:
            try:
                done(
                    self.core.delete_namespaced_pod(
                        pod["metadata"]["name"],
                        self.namespace,
                        grace_period_seconds=pod["spec"].get("terminationGracePeriodSeconds", 30),
                        _preload_content=False,
                    )
                )
            except ApiException as e:
                if e.status != 404:
                    raise

    def _create_pod(self, job: dict[str, Any], index: int | None) -> None:
        """A pod of the Job; of an Indexed Job (``index``), annotated with its index, its hostname
        ``<job>-<index>``, as the Job controller makes them."""
        template = job["spec"]["template"]
        suffix = secrets.token_hex(3)[:5]
        annotations = template["metadata"].get("annotations", {})
        spec = template["spec"]
        if index is not None:
            annotations = {**annotations, INDEX_ANNOTATION: str(index)}
            spec = {**spec, "hostname": f"{job['metadata']['name']}-{index}"}
        metadata = {
            **template["metadata"],
            "annotations": annotations,
            "name": f"{job['metadata']['name']}-{'' if index is None else f'{index}-'}{suffix}",
            "labels": {
                **template["metadata"].get("labels", {}),
                "job-name": job["metadata"]["name"],
                "controller-uid": job["metadata"]["uid"],
            },
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job["metadata"]["name"],
                    "uid": job["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }
        done(
            self.core.create_namespaced_pod(
                self.namespace,
                {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec},
                _preload_content=False,
            )
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _value(pod: dict[str, Any], var: dict[str, Any]) -> str:
    """An ``env`` entry's value, as the kubelet gives it: its own, or a field of the pod's."""
    if "value" in var:
        return str(var["value"])
    path = var["valueFrom"]["fieldRef"]["fieldPath"]
    if path == "status.podIP":
        return "127.0.0.1"
    annotation = path.removeprefix("metadata.annotations['").removesuffix("']")
    return str(pod["metadata"]["annotations"][annotation])


def _index(pod: dict[str, Any]) -> int | None:
    """An Indexed Job's pod's index; None for a pod of another Job."""
    index = pod["metadata"].get("annotations", {}).get(INDEX_ANNOTATION)
    return None if index is None else int(index)


def _sync_until_stopped(sync: Callable[[], None], stop: threading.Event, who: str) -> None:
    """The kubelet's and the Job controller's loop: ``sync`` every ``POLL_S`` until ``stop``."""
    while not stop.is_set():
        try:
            sync()
        except ApiException as e:
            if stop.is_set():
                return
            print(f"{who} sync failed: {e}", file=sys.stderr)
        stop.wait(POLL_S)
