"""The launcher on Kubernetes (official client): training pods as Jobs, rollout pods one Pod per slot.

A training pod is a ``batch/v1`` Job named after it (``<run>-train-<iteration>``) on the
on-demand training pool: the Job controller gives it a retry when a node goes away
(``podFailurePolicy`` ignores ``DisruptionTarget``: a preemption is not the job's failure), and
``backoffLimit`` counts only the job's own failures; the scheduler keeps its own retry count
across Jobs. ``activeDeadlineSeconds`` bounds a hung job; ``ttlSecondsAfterFinished`` removes a
Job that no scheduler reaped (one normally deletes it a tick after it ends).

Rollout pods are bare Pods, one per slot (``<run>-rollout-<slot>``), not a Deployment: the
scheduler relies on each worker's stable identity (the worker id is the pod name; its consumer
session, its ledger entry and its stop are per slot) and stops and reaps slots one by one, as a
spot node's loss takes one of them. A Deployment's pods have random names, and scaling it down
picks which pod dies itself. The pods select spot capacity through the providers' usual labels
(``spot_labels``: Karpenter's, EKS managed node groups', GKE's, configurable; any one of them
matches), and ``terminationGracePeriodSeconds`` covers the spot notice (120 s on AWS), so a
worker handed SIGTERM finishes or hands back its batch before the node goes.

Kubernetes only signals a pod by deleting it, and then forgets it once it has ended, exit code
and all. So every pod carries the finalizer ``spotrl.dev/reap``: ``stop`` deletes the pod with
its grace period (SIGTERM, SIGKILL after it), the ended pod stays readable, and ``delete``
removes the finalizer. A training Job is stopped by setting its parallelism to 0 (the Job
controller starts no new pod) and deleting its running pods the same way.

Each role (rollout, training) has its own image, node selector and tolerations
(``KubernetesConfig``; the chart's ``SPOTRL_KUBE_*`` settings, services/wiring.py). Pods inherit
the launcher's ``SPOTRL_*`` settings, but never a secret one as a value in the pod spec: with
``env_secrets`` the backends' URLs (and any setting named as a secret) reach them only through
``envFrom`` of those Secrets, which the launcher never reads. The price catalog the settings name
(``SPOTRL_PRICE_CATALOG``, a file of the control plane's pod) is mounted in each pod at the same
path from its ConfigMap. A Job's PodStatus keeps the Job's name (``name``: the scheduler's) and
gives its current pod's (``platform_name``), the one a GPU exporter labels its metrics with.

Status comes from watches (pods and Jobs of the namespace that spotrl manages), resumed from the
last resourceVersion seen, and listed again only when the server no longer has that version
(410 Gone): a tick reads the launcher's cache, not the API. The node's instance type and
capacity type come from its labels (``node.kubernetes.io/instance-type``, the capacity labels).
Timestamps are Kubernetes', whole seconds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from services.backends.launcher import PodNotFoundError, PodPhase, PodSpec, PodStatus, check_pod_name

log = logging.getLogger(__name__)

FINALIZER = "spotrl.dev/reap"
MANAGED_BY = {"app.kubernetes.io/managed-by": "spotrl"}
SELECTOR = "app.kubernetes.io/managed-by=spotrl"
POD_LABEL = "spotrl.dev/pod"  # the launcher's pod name, on the Job and on each of its pods
SPEC_ANNOTATION = "spotrl.dev/spec"  # run, role, asked instance and capacity type, the spec's labels (JSON)
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
CONTAINER = "main"
# The providers' labels of spot capacity; a node carries at most one provider's.
SPOT_LABELS = {"karpenter.sh/capacity-type": "spot", "eks.amazonaws.com/capacityType": "SPOT",
               "cloud.google.com/gke-spot": "true"}  # fmt: skip
WATCH_TIMEOUT_S = 300  # the server ends each watch after this long; it is resumed at once
RETRY_S = 1.0  # after a failed watch or list (the API server restarting, a network blip)
CLOSE_TIMEOUT_S = 10.0  # then the (daemon) watch thread is left to die with the process


# Settings that may carry a password: the backends' URLs, and any named as a secret (Kafka's
# SPOTRL_KAFKA_SASL_PLAIN_PASSWORD). With env_secrets they reach pods from those Secrets only.
SECRET_SETTINGS = frozenset({"SPOTRL_STATE_URL", "SPOTRL_QUEUE_URL", "SPOTRL_REWARD_CACHE_URL"})
SECRET_NAME = re.compile("PASSWORD|SECRET|TOKEN")
CATALOG_VOLUME = "price-catalog"
ROLES = ("rollout", "training")  # each role's pods run on its own pool


def _pool_tolerations(pool: str, *extra: dict[str, str]) -> list[dict[str, Any]]:
    """The pool's taint (so that only spotrl's pods land there) and the GPU nodes' usual one."""
    return [{"key": "spotrl.dev/pool", "operator": "Equal", "value": pool, "effect": "NoSchedule"},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, *extra]  # fmt: skip


@dataclass(frozen=True)
class KubernetesConfig:
    """Where and how the launcher's pods run."""

    namespace: str = "default"
    image: str = "spotrl:latest"  # the data-plane image: spotrl installed, `python` on PATH
    images: dict[str, str] = field(default_factory=dict)  # a role's own image (rollout, training), else `image`
    python: str = "python"  # the image's interpreter, run where a command names the launcher's own
    image_pull_policy: str | None = None  # unset: Kubernetes' default
    image_pull_secrets: tuple[str, ...] = ()
    service_account: str | None = None  # the pods' identity (S3 access); no token is mounted: a pod launches nothing
    # Secrets the pods read their environment from (envFrom); then no secret setting is a value in a pod spec.
    env_secrets: tuple[str, ...] = ()
    # The price catalog's ConfigMap, mounted where SPOTRL_PRICE_CATALOG (the launcher's own) names the file.
    price_catalog_configmap: str | None = None
    pod_labels: dict[str, str] = field(default_factory=dict)  # besides the launcher's own (a NetworkPolicy's)
    spot_labels: dict[str, str] = field(default_factory=lambda: dict(SPOT_LABELS))
    node_selectors: dict[str, dict[str, str]] = field(default_factory=lambda: {
        role: {"spotrl.dev/pool": role} for role in ROLES})  # fmt: skip
    tolerations: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {
        "rollout": _pool_tolerations("rollout", {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                                                 "effect": "NoSchedule"}),
        "training": _pool_tolerations("training")})  # fmt: skip
    spot_notice_s: int = 120  # AWS's two-minute interruption notice: a rollout pod's grace period
    training_grace_s: int = 60  # a training job stopped mid-step has nothing to hand back
    training_deadline_s: int = 6 * 3600  # activeDeadlineSeconds of a training Job
    # Failures of the job's own (preemptions excluded) before the Job fails; the scheduler retries
    # a failed job as a new Job after its own backoff, so none here.
    backoff_limit: int = 0
    ttl_after_finished_s: int = 24 * 3600


def _gpus_from_catalog(instance_type: str) -> int:
    from services.cost.catalog import load_catalog

    return load_catalog().get(instance_type).gpus


def inherited_env() -> dict[str, str]:
    """The launcher's own SPOTRL_* settings (backends' URLs, Kafka and pod settings) for its pods, but
    not the launcher's: a pod launches nothing, and so opens no Kubernetes client."""
    return {k: v for k, v in os.environ.items()
            if k.startswith("SPOTRL_") and k != "SPOTRL_LAUNCHER" and not k.startswith("SPOTRL_KUBE_")}  # fmt: skip


# --- manifests: pure functions of the spec ----------------------------------------------------


def pod_manifest(spec: PodSpec, cfg: KubernetesConfig, gpus: int, env: dict[str, str]) -> dict[str, Any]:
    """A rollout pod: a bare Pod named after the spec, on the spot (or on-demand) rollout pool."""
    return {"apiVersion": "v1", "kind": "Pod", **_template(spec, cfg, gpus, env)}


def job_manifest(spec: PodSpec, cfg: KubernetesConfig, gpus: int, env: dict[str, str]) -> dict[str, Any]:
    """A training pod: a Job of one pod on the on-demand training pool."""
    template = _template(spec, cfg, gpus, env)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {k: v for k, v in template["metadata"].items() if k != "finalizers"},
        "spec": {
            "completions": 1,
            "parallelism": 1,
            "backoffLimit": cfg.backoff_limit,
            "activeDeadlineSeconds": cfg.training_deadline_s,
            "ttlSecondsAfterFinished": cfg.ttl_after_finished_s,
            # A pod ended by its node's loss (preemption, drain, eviction) is retried, uncounted.
            "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
            "template": {"metadata": {k: v for k, v in template["metadata"].items() if k != "name"},
                         "spec": template["spec"]},
        },
    }


def _template(spec: PodSpec, cfg: KubernetesConfig, gpus: int, env: dict[str, str]) -> dict[str, Any]:
    training = spec.role == "training"
    # A standby (the scheduler's warm training node) holds a training node: the training pool's everything.
    pool_role = "training" if spec.role == "standby" else spec.role
    described = {"run_id": spec.run_id, "role": spec.role, "instance_type": spec.instance_type,
                 "capacity_type": spec.capacity_type, "labels": spec.labels}  # fmt: skip
    labels = {**cfg.pod_labels, **MANAGED_BY, POD_LABEL: spec.name, "spotrl.dev/run": spec.run_id,
              "spotrl.dev/role": spec.role, **{f"spotrl.dev/{k}": v for k, v in spec.labels.items()}}  # fmt: skip
    command = list(spec.command)
    if command and command[0] == sys.executable:  # the scheduler's interpreter path means nothing in the image
        command[0] = cfg.python
    # The capacity type is each pod's own (the affinity below): a pool's capacity label, such as a
    # rollout pool's karpenter.sh/capacity-type=spot, would leave an on-demand rollout pod no node.
    # The instance type is the spec's: the one the scheduler bills.
    pool = {k: v for k, v in cfg.node_selectors.get(pool_role, {}).items() if k not in cfg.spot_labels}
    gpu = {"nvidia.com/gpu": str(gpus)}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": cfg.images.get(pool_role, cfg.image),
        "command": command,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items()) if not (cfg.env_secrets and _secret(k))],
        "resources": {"requests": gpu, "limits": gpu},
    }
    if cfg.env_secrets:
        container["envFrom"] = [{"secretRef": {"name": name}} for name in cfg.env_secrets]
    if cfg.image_pull_policy:
        container["imagePullPolicy"] = cfg.image_pull_policy
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": cfg.training_grace_s if training else cfg.spot_notice_s,
        "nodeSelector": {**pool, INSTANCE_TYPE_LABEL: spec.instance_type},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": _capacity_terms(spec.capacity_type == "spot", cfg.spot_labels)}}},
        "tolerations": cfg.tolerations.get(pool_role, []),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [container],
    }  # fmt: skip
    if cfg.service_account:
        pod["serviceAccountName"] = cfg.service_account
    if cfg.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in cfg.image_pull_secrets]
    # The catalog file the pod's settings name (inherited from the launcher's) is where its own pod mounts it.
    if cfg.price_catalog_configmap and (catalog := env.get("SPOTRL_PRICE_CATALOG")):
        pod["volumes"] = [{"name": CATALOG_VOLUME, "configMap": {"name": cfg.price_catalog_configmap}}]
        container["volumeMounts"] = [{"name": CATALOG_VOLUME, "mountPath": str(PurePosixPath(catalog).parent),
                                      "readOnly": True}]  # fmt: skip
    metadata = {"name": spec.name, "labels": labels, "finalizers": [FINALIZER],
                "annotations": {SPEC_ANNOTATION: json.dumps(described, sort_keys=True)}}  # fmt: skip
    return {"metadata": metadata, "spec": pod}


def _secret(name: str) -> bool:
    return name in SECRET_SETTINGS or bool(SECRET_NAME.search(name))


def _capacity_terms(spot: bool, spot_labels: dict[str, str]) -> list[dict[str, Any]]:
    """Node selector terms (ORed) for spot capacity: any provider's spot label; for on-demand, none of them."""
    if spot:
        return [{"matchExpressions": [{"key": k, "operator": "In", "values": [v]}]} for k, v in spot_labels.items()]
    return [{"matchExpressions": [{"key": k, "operator": "NotIn", "values": [v]} for k, v in spot_labels.items()]}]


# --- status: pure functions of what the watches saw --------------------------------------------


def _time(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def _terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    for container in pod.get("status", {}).get("containerStatuses") or []:
        if "terminated" in (container.get("state") or {}):
            return container["state"]["terminated"]
    return None


def _exit_code(terminated: dict[str, Any] | None) -> int | None:
    """The container's exit code, a signal death as its negative number (the runtimes report 128+n)."""
    if terminated is None:
        return None
    if terminated.get("signal"):
        return -terminated["signal"]
    code = terminated.get("exitCode")
    return -(code - 128) if code is not None and 128 < code <= 128 + 64 else code


def _disrupted(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])  # fmt: skip


def _pod_ended(pod: dict[str, Any]) -> bool:
    # A pod deleted before any node took it never runs: nothing will end it but us.
    never_ran = pod["metadata"].get("deletionTimestamp") and not pod["spec"].get("nodeName")
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed") or bool(never_ran)


def status_of(obj: dict[str, Any], pods: list[dict[str, Any]], node_labels: Callable[[str], dict[str, str]],
              spot_labels: dict[str, str]) -> PodStatus:
    """The PodStatus of a bare pod (``pods`` is itself) or of a Job (``pods`` are its pods, oldest first)."""
    described = json.loads(obj["metadata"]["annotations"][SPEC_ANNOTATION])
    latest = pods[-1] if pods else None
    terminated = _terminated(latest) if latest else None
    instance_type, capacity_type = described["instance_type"], described["capacity_type"]
    node = latest["spec"].get("nodeName") if latest else None
    labels = node_labels(node) if node else {}
    if labels:  # what the pod got; else (not on a node yet, or the node gone) what it asked for
        instance_type = labels.get(INSTANCE_TYPE_LABEL, instance_type)
        capacity_type = "spot" if any(labels.get(k) == v for k, v in spot_labels.items()) else "on-demand"
    started_at = _time(obj.get("status", {}).get("startTime")) or _time(obj["metadata"]["creationTimestamp"])
    ended_at = _time(terminated.get("finishedAt")) if terminated else None
    if obj["kind"] == "Job":
        conditions = {c["type"]: c for c in obj.get("status", {}).get("conditions") or [] if c.get("status") == "True"}
        if "Complete" in conditions:
            phase = PodPhase.SUCCEEDED
        elif "Failed" in conditions:
            phase = PodPhase.FAILED
        elif obj["spec"].get("parallelism") == 0 and all(_pod_ended(p) for p in pods):  # stopped
            phase = PodPhase.SUCCEEDED if latest and _exit_code(terminated) == 0 else PodPhase.FAILED
        else:
            phase = PodPhase.RUNNING
        if phase is not PodPhase.RUNNING:
            ended = conditions.get("Complete") or conditions.get("Failed")
            ended_at = _time(obj["status"].get("completionTime")) or (ended_at if ended is None else _time(ended["lastTransitionTime"]))
    else:
        pod_phase = obj.get("status", {}).get("phase")
        phase = {"Succeeded": PodPhase.SUCCEEDED, "Failed": PodPhase.FAILED}.get(
            pod_phase, PodPhase.FAILED if _pod_ended(obj) else PodPhase.RUNNING)
    return PodStatus(
        name=obj["metadata"]["name"],
        run_id=described["run_id"],
        role=described["role"],
        instance_type=instance_type,
        capacity_type=capacity_type,
        labels=described["labels"],
        phase=phase,
        exit_code=_exit_code(terminated) if phase is not PodPhase.RUNNING else None,
        started_at=started_at,
        ended_at=ended_at if phase is not PodPhase.RUNNING else None,
        pid=None,
        platform_name=latest["metadata"]["name"] if obj["kind"] == "Job" and latest else None,
        preempted=phase is PodPhase.FAILED and latest is not None and _disrupted(latest),
    )


# --- the watches ------------------------------------------------------------------------------


class Watched:
    """One kind's objects in a namespace (those spotrl manages), kept current by a watch.

    Listed once, then watched from the list's resourceVersion, each watch resumed from the last
    version it delivered; listed again only when the server has compacted that version away
    (410 Gone, or the 409 some servers answer for a version too old). The launcher's own writes
    reach the cache at once (``put``, ``forget``), so that what it just launched or deleted reads
    back as such before the watch delivers the event.
    """

    def __init__(self, list_fn: Callable[..., Any], namespace: str) -> None:
        self._list_fn = list_fn
        self._namespace = namespace
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, Any]] = {}
        self._forgotten: set[str] = set()  # uids deleted by us whose DELETED event has not come yet
        self.resource_version = ""
        self.relists = 0
        self._stopped = threading.Event()
        self._response: Any = None
        self.relist()
        self._thread = threading.Thread(target=self._run, name=f"watch-{list_fn.__name__}", daemon=True)
        self._thread.start()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._objects.values())

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(name)

    def put(self, obj: dict[str, Any]) -> None:
        with self._lock:
            if obj["metadata"]["uid"] not in self._forgotten:
                self._objects[obj["metadata"]["name"]] = obj

    def forget(self, obj: dict[str, Any]) -> None:
        with self._lock:
            self._forgotten.add(obj["metadata"]["uid"])
            if self._objects.get(obj["metadata"]["name"], {}).get("metadata", {}).get("uid") == obj["metadata"]["uid"]:
                del self._objects[obj["metadata"]["name"]]

    def relist(self) -> None:
        listed = self._read(self._list_fn(self._namespace, label_selector=SELECTOR, _preload_content=False))
        kind = listed["kind"].removesuffix("List")
        with self._lock:
            uids = {o["metadata"]["uid"] for o in listed["items"]}
            self._forgotten &= uids
            self._objects = {o["metadata"]["name"]: {"kind": kind, **o} for o in listed["items"]
                             if o["metadata"]["uid"] not in self._forgotten}  # fmt: skip
            self.resource_version = listed["metadata"]["resourceVersion"]
            self.relists += 1

    def close(self) -> None:
        self._stopped.set()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            response = self._response
            if response is not None:
                response.shutdown()  # unblocks the watch thread's read
            self._thread.join(timeout=0.05)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                for event in self._events():
                    self._apply(event)
            except ApiException as e:
                if e.status in (409, 410):  # the version we resume from is gone: start over from a list
                    log.info("watch of %s: resourceVersion %s is gone (%s); listing again",
                             self._list_fn.__name__, self.resource_version, e.status)
                    self._retry(self.relist)
                else:
                    log.warning("watch of %s failed: %s", self._list_fn.__name__, e)
                    self._stopped.wait(RETRY_S)
            except (urllib3.exceptions.HTTPError, OSError, ValueError) as e:
                if not self._stopped.is_set():
                    log.warning("watch of %s broke: %s; resuming", self._list_fn.__name__, e)
                    self._stopped.wait(RETRY_S)

    def _retry(self, action: Callable[[], None]) -> None:
        while not self._stopped.is_set():
            try:
                return action()
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as e:
                log.warning("listing %s failed: %s", self._list_fn.__name__, e)
                self._stopped.wait(RETRY_S)

    def _events(self) -> Iterator[dict[str, Any]]:
        response = self._list_fn(self._namespace, label_selector=SELECTOR, watch=True, allow_watch_bookmarks=True,
                                 resource_version=self.resource_version, timeout_seconds=WATCH_TIMEOUT_S,
                                 _preload_content=False)  # fmt: skip
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if self._stopped.is_set():
                    return
                if line:
                    yield json.loads(line)
        finally:
            self._response = None
            response.close()  # not back to the pool: the rest of the stream is unread

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            raise ApiException(status=obj.get("code"), reason=f"{obj.get('reason')}: {obj.get('message')}")
        with self._lock:
            self.resource_version = obj["metadata"]["resourceVersion"]
            if kind == "BOOKMARK":
                return
            name, uid = obj["metadata"]["name"], obj["metadata"]["uid"]
            if kind == "DELETED":
                self._forgotten.discard(uid)
                if self._objects.get(name, {}).get("metadata", {}).get("uid") == uid:
                    del self._objects[name]
            elif uid not in self._forgotten:
                self._objects[name] = obj

    @staticmethod
    def _read(response: Any) -> dict[str, Any]:
        try:
            return json.loads(response.data)
        finally:
            response.release_conn()


def _done(response: Any) -> None:
    """Back to the pool once read to its end: a connection with an answer unread would hand its
    rest to the next request on it."""
    response.drain_conn()
    response.release_conn()


# --- the launcher -----------------------------------------------------------------------------


class KubernetesLauncher:
    """The Launcher port on a Kubernetes namespace (module docstring)."""

    def __init__(self, api: client.ApiClient, cfg: KubernetesConfig,
                 gpus: Callable[[str], int] = _gpus_from_catalog) -> None:  # fmt: skip
        self.cfg = cfg
        self._api = api
        self._core = client.CoreV1Api(api)
        self._batch = client.BatchV1Api(api)
        self._gpus = gpus
        self._nodes: dict[str, dict[str, str]] = {}  # node name -> labels; a node's type never changes
        self.pods = Watched(self._core.list_namespaced_pod, cfg.namespace)
        self.jobs = Watched(self._batch.list_namespaced_job, cfg.namespace)

    @classmethod
    def from_environment(cls, cfg: KubernetesConfig, kubeconfig: str | None = None) -> KubernetesLauncher:
        """In a pod: its service account (in-cluster config); elsewhere the kubeconfig (``kubeconfig``
        or $KUBECONFIG or ~/.kube/config)."""
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            return cls(client.ApiClient(), cfg)
        return cls(config.new_client_from_config(config_file=kubeconfig), cfg)

    def close(self) -> None:
        self.pods.close()
        self.jobs.close()
        self._api.close()

    def launch(self, spec: PodSpec) -> None:
        check_pod_name(spec.name)
        env = inherited_env() | spec.env
        gpus = self._gpus(spec.instance_type)
        try:
            if spec.role == "training":
                created = self._read(self._batch.create_namespaced_job(
                    self.cfg.namespace, job_manifest(spec, self.cfg, gpus, env), _preload_content=False))
                self.jobs.put({"kind": "Job", **created})
            else:
                created = self._read(self._core.create_namespaced_pod(
                    self.cfg.namespace, pod_manifest(spec, self.cfg, gpus, env), _preload_content=False))
                self.pods.put({"kind": "Pod", **created})
        except ApiException as e:
            if e.status != 409:  # AlreadyExists: the pod of that name is this one
                raise

    def list(self, run_id: str | None = None) -> list[PodStatus]:
        # Oldest first (a Job's latest pod last); within a second, a running pod after ended ones.
        pods = sorted(self.pods.snapshot(), key=lambda p: (p["metadata"]["creationTimestamp"], not _pod_ended(p)))
        of_job: dict[str, list[dict[str, Any]]] = {}
        statuses = []
        for pod in pods:
            owner = pod["metadata"]["labels"].get(POD_LABEL)
            if owner == pod["metadata"]["name"]:
                statuses.append(status_of(pod, [pod], self._node_labels, self.cfg.spot_labels))
            else:
                of_job.setdefault(owner, []).append(pod)
        for job in self.jobs.snapshot():
            statuses.append(status_of(job, of_job.get(job["metadata"]["name"], []), self._node_labels,
                                      self.cfg.spot_labels))
        return sorted((s for s in statuses if run_id is None or s.run_id == run_id), key=lambda s: s.name)

    def stop(self, name: str, grace_s: float) -> None:
        grace = max(0, math.ceil(grace_s))
        job = self.jobs.get(name)
        if job is not None:
            self._ignore_missing(lambda: self._batch.patch_namespaced_job(
                name, self.cfg.namespace, {"spec": {"parallelism": 0}},
                _content_type="application/merge-patch+json", _preload_content=False))
            pods = [p for p in self.pods.snapshot() if p["metadata"]["labels"].get(POD_LABEL) == name
                    and p["metadata"]["name"] != name]  # fmt: skip
        else:
            pods = [p for p in [self.pods.get(name)] if p is not None]
        for pod in pods:
            if not _pod_ended(pod):
                self._ignore_missing(lambda: self._core.delete_namespaced_pod(
                    pod["metadata"]["name"], self.cfg.namespace, grace_period_seconds=grace, _preload_content=False))

    def delete(self, name: str) -> None:
        job = self.jobs.get(name)
        if job is not None:
            self._ignore_missing(lambda: self._batch.delete_namespaced_job(
                name, self.cfg.namespace, propagation_policy="Background", _preload_content=False))
            self.jobs.forget(job)
        for pod in [p for p in self.pods.snapshot() if p["metadata"]["labels"].get(POD_LABEL) == name]:
            pod_name = pod["metadata"]["name"]
            # Off with the finalizer, then a delete without grace: gone at once, killed if it ran.
            self._ignore_missing(lambda: self._core.patch_namespaced_pod(
                pod_name, self.cfg.namespace, {"metadata": {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}},
                _content_type="application/strategic-merge-patch+json", _preload_content=False))
            self._ignore_missing(lambda: self._core.delete_namespaced_pod(
                pod_name, self.cfg.namespace, grace_period_seconds=0, _preload_content=False))
            self.pods.forget(pod)

    def logs(self, name: str, tail: int = 100) -> str:
        check_pod_name(name)
        candidates = sorted((p for p in self.pods.snapshot() if p["metadata"]["labels"].get(POD_LABEL) == name),
                            key=lambda p: (p["metadata"]["creationTimestamp"], not _pod_ended(p)))  # fmt: skip
        if not candidates:
            if self.jobs.get(name) is not None:
                return ""  # the Job controller has not created its pod yet
            raise PodNotFoundError(f"no pod {name!r} in namespace {self.cfg.namespace}")
        if tail <= 0:
            return ""
        try:
            response = self._core.read_namespaced_pod_log(
                candidates[-1]["metadata"]["name"], self.cfg.namespace, container=CONTAINER, tail_lines=tail,
                _preload_content=False)  # fmt: skip
        except ApiException as e:
            if e.status == 404:
                raise PodNotFoundError(f"no pod {name!r} in namespace {self.cfg.namespace}") from None
            if e.status == 400:  # not on a node yet, or its container not started: no output so far
                return ""
            raise
        try:
            return response.data.decode(errors="replace")
        finally:
            response.release_conn()

    def _node_labels(self, node: str) -> dict[str, str]:
        if node not in self._nodes:
            try:
                found = self._read(self._core.read_node(node, _preload_content=False))
            except ApiException as e:
                if e.status != 404:
                    raise
                return {}  # the node has gone (a reclaimed spot machine): what was asked stands
            self._nodes[node] = found["metadata"].get("labels", {})
        return self._nodes[node]

    @staticmethod
    def _read(response: Any) -> dict[str, Any]:
        return Watched._read(response)

    @staticmethod
    def _ignore_missing(call: Callable[[], Any]) -> None:
        try:
            _done(call())
        except ApiException as e:
            if e.status != 404:
                raise
