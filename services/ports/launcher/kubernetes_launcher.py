"""The launcher on Kubernetes (official client): training pods as Jobs, rollout pods one Pod per slot.

A training pod of several nodes (``PodSpec.nodes``, a multi-node update) is an Indexed Job of one
pod per node (``completions`` = ``parallelism`` = nodes), each pod's index its node's rank
(torchrun's ``--node-rank``, from the index annotation), with a headless Service of the Job's
name that gives the pods DNS names (``<job>-<index>.<job>``): node 0's is the rendezvous. Its
nodes start, are billed (one ledger entry each) and end together: any pod's failure fails the
Job (``backoffLimit`` 0), and a node's loss fails it too (``FailJob`` whatever the capacity: a
pod recreated alone cannot rejoin the others), reported preempted; the scheduler relaunches the
iteration as a new Job. The Service is owned by the Job, and deleted with it. The standby that
holds such a job's warm nodes is a Job of as many pods alike.

A training pod is a ``batch/v1`` Job named after it (``<run>-train-<iteration>``) on the
training pool, on-demand or spot as the scheduler chose (``PodSpec.capacity_type``). A pod ended
by its node's loss (the ``DisruptionTarget`` condition: a spot reclaim, a drain, an eviction) has
not failed of its own, and the Job's ``podFailurePolicy`` (``pod_failure_policy``) says what
becomes of the Job:

- on-demand, ``Ignore``: the Job controller makes a new pod in the same Job, uncounted. A drain or
  an eviction is rare there, and an on-demand node comes back at once.
- spot, ``FailJob``: the Job ends with its pod, which ``list`` reports ended with
  ``preempted=True``; the scheduler reaps the Job and relaunches the iteration as a new Job of the
  same name (a new entry in the cost ledger), which resumes from the checkpoint the job wrote at
  its SIGTERM. Recreated inside the old Job, the pod could wait long for spot capacity while the
  Job, and the one ledger entry for it, ran on with no machine held.

A spot training pod's grace period is the spot notice (``spot_notice_s``), time to write that
checkpoint; an on-demand one's is ``training_grace_s``. ``backoffLimit`` counts only the job's own
failures; the scheduler keeps its own retry count across Jobs. ``activeDeadlineSeconds`` bounds a
hung job; ``ttlSecondsAfterFinished`` removes a Job that no scheduler reaped (one normally deletes
it a tick after it ends).

Rollout pods are bare Pods, one per slot (``<run>-rollout-<slot>``), not a Deployment: the
scheduler relies on each worker's stable identity (the worker id is the pod name; its consumer
session, its ledger entry and its stop are per slot) and stops and reaps slots one by one, as a
spot node's loss takes one of them. A Deployment's pods have random names, and scaling it down
picks which pod dies itself. Spot pods, rollout and training alike, select spot capacity through
the providers' usual labels (``spot_labels``: Karpenter's, EKS managed node groups', GKE's,
configurable; any one of them matches; an on-demand pod matches none) and tolerate, by their
pools' default tolerations, GKE's spot taint. ``terminationGracePeriodSeconds`` covers the spot
notice (120 s on AWS), so a worker handed SIGTERM finishes or hands back its batch before the
node goes.

Kubernetes only signals a pod by deleting it, and then forgets it once it has ended, exit code
and all. So every pod carries the finalizer ``spotrl.dev/reap``: ``stop`` deletes the pod with
its grace period (SIGTERM, SIGKILL after it), the ended pod stays readable, and ``delete``
removes the finalizer. A training Job is stopped by setting its parallelism to 0 (the Job
controller starts no new pod) and deleting its running pods the same way. With no spotrl process
left to remove it, the finalizer would hold the pods (and a namespace being deleted) forever: an
uninstall first runs ``spotrl teardown`` (services/control/scheduler/teardown.py; the chart's pre-delete
hook), which stops and deletes every pod and Job of the namespace that spotrl manages.

Each pod is sized by its instance type (the price catalog's vCPUs and memory, ``Machine``): it
requests all its GPUs and a share (``request_fraction``) of its CPU and memory, so that the
kubelet does not evict it first, and gets a memory-backed ``/dev/shm`` (``shm_fraction`` of the
memory) for NCCL between torchrun's ranks and for vLLM's workers. It runs as the Pod Security
Standards' "restricted" profile asks: a non-root uid, no privilege escalation, no capabilities,
the runtime's seccomp profile, and a read-only root filesystem with emptyDirs at ``/tmp`` and the
images' home (the model cache).

Each role (rollout, training) has its own image, node selector and tolerations (eval pods take the
rollout pool's, standby pods the training pool's)
(``KubernetesConfig``; the chart's ``SPOTRL_KUBE_*`` settings, services/ports/wiring.py). Pods inherit
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

import contextlib
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from services.ports.launcher.kubernetes_objects import (
    CONTAINER,
    FINALIZER,
    POD_LABEL,
    SELECTOR,
    SPEC_ANNOTATION,
    KubernetesConfig,
    Machine,
    inherited_env,
    job_manifest,
    machine_from_catalog,
    pod_ended,
    pod_manifest,
    service_manifest,
    status_of,
)
from services.ports.launcher.launcher import PodNotFoundError, PodSpec, PodStatus, check_pod_name, node_names

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300  # the server ends each watch after this long; it is resumed at once
RETRY_S = 1.0  # after a failed watch or list (the API server restarting, a network blip)
CLOSE_TIMEOUT_S = 10.0  # then the (daemon) watch thread is left to die with the process


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
            self._objects = {
                o["metadata"]["name"]: {"kind": kind, **o}
                for o in listed["items"]
                if o["metadata"]["uid"] not in self._forgotten
            }
            self.resource_version = listed["metadata"]["resourceVersion"]
            self.relists += 1

    def close(self) -> None:
        self._stopped.set()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            response = self._response
            if response is not None:
                # Unblocks the watch thread's read; a socket it has closed meanwhile (its watch
                # ended as we looked) has no read left to unblock.
                with contextlib.suppress(OSError):
                    response.shutdown()
            self._thread.join(timeout=0.05)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                for event in self._events():
                    self._apply(event)
            except ApiException as e:
                if e.status in (409, 410):  # the version we resume from is gone: start over from a list
                    log.info(
                        "watch of %s: resourceVersion %s is gone (%s); listing again",
                        self._list_fn.__name__,
                        self.resource_version,
                        e.status,
                    )
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
        response = self._list_fn(
            self._namespace,
            label_selector=SELECTOR,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=self.resource_version,
            timeout_seconds=WATCH_TIMEOUT_S,
            _preload_content=False,
        )
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

    def __init__(
        self, api: client.ApiClient, cfg: KubernetesConfig, machines: Callable[[str], Machine] = machine_from_catalog
    ) -> None:
        self.cfg = cfg
        self._api = api
        self._core = client.CoreV1Api(api)
        self._batch = client.BatchV1Api(api)
        self._machines = machines
        self._nodes: dict[str, dict[str, Any]] = {}  # node name -> metadata; a node's type and birth never change
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
        for name in node_names(spec.name, spec.nodes):  # a Job's pods' hostnames too
            check_pod_name(name)
        env = inherited_env() | spec.env
        machine = self._machines(spec.instance_type)
        if spec.role == "training" or spec.nodes > 1:  # a standby of a multi-node job holds its nodes
            self._launch_job(spec, machine, env)
            return
        manifest = pod_manifest(spec, self.cfg, machine, env)
        created = self._create(
            lambda: self._core.create_namespaced_pod(self.cfg.namespace, manifest, _preload_content=False)
        )
        if created is not None:
            self.pods.put({"kind": "Pod", **created})

    def _launch_job(self, spec: PodSpec, machine: Machine, env: dict[str, str]) -> None:
        """The training Job (or a multi-node job's standby's), and the headless Service of one of
        several nodes, owned by it (either may exist already: a launch retried after a failure
        between the two)."""
        manifest = job_manifest(spec, self.cfg, machine, env)
        job = self._create(
            lambda: self._batch.create_namespaced_job(self.cfg.namespace, manifest, _preload_content=False)
        )
        if job is not None:
            self.jobs.put({"kind": "Job", **job})
        if spec.nodes == 1:
            return
        if job is None:
            job = self._read(self._batch.read_namespaced_job(spec.name, self.cfg.namespace, _preload_content=False))
        service = service_manifest(spec, self.cfg, job["metadata"]["uid"])
        self._create(lambda: self._core.create_namespaced_service(self.cfg.namespace, service, _preload_content=False))

    @classmethod
    def _create(cls, call: Callable[[], Any]) -> dict[str, Any] | None:
        """The object `call` created, or None when one of that name exists already (409
        AlreadyExists): a launch retried, so the object of that name is this one."""
        try:
            return cls._read(call())
        except ApiException as e:
            if e.status != 409:
                raise
            return None

    def list(self, run_id: str | None = None) -> list[PodStatus]:
        # Oldest first (a Job's latest pod last); within a second, a running pod after ended ones.
        pods = sorted(self.pods.snapshot(), key=lambda p: (p["metadata"]["creationTimestamp"], not pod_ended(p)))
        of_job: dict[str, list[dict[str, Any]]] = {}
        statuses = []
        for pod in pods:
            owner = pod["metadata"]["labels"].get(POD_LABEL)
            if owner == pod["metadata"]["name"]:
                statuses.append(status_of(pod, [pod], self._node_metadata, self.cfg.spot_labels))
            else:
                of_job.setdefault(owner, []).append(pod)
        for job in self.jobs.snapshot():
            statuses.append(
                status_of(job, of_job.get(job["metadata"]["name"], []), self._node_metadata, self.cfg.spot_labels)
            )
        return sorted((s for s in statuses if run_id is None or s.run_id == run_id), key=lambda s: s.name)

    def stop(self, name: str, grace_s: float) -> None:
        grace = max(0, math.ceil(grace_s))
        job = self.jobs.get(name)
        if job is not None:
            self._ignore_missing(
                functools.partial(
                    self._batch.patch_namespaced_job,
                    name,
                    self.cfg.namespace,
                    {"spec": {"parallelism": 0}},
                    _content_type="application/merge-patch+json",
                    _preload_content=False,
                )
            )
            pods = [
                p
                for p in self.pods.snapshot()
                if p["metadata"]["labels"].get(POD_LABEL) == name and p["metadata"]["name"] != name
            ]
        else:
            pods = [p for p in [self.pods.get(name)] if p is not None]
        for pod in pods:
            if not pod_ended(pod):
                self._ignore_missing(
                    functools.partial(
                        self._core.delete_namespaced_pod,
                        pod["metadata"]["name"],
                        self.cfg.namespace,
                        grace_period_seconds=grace,
                        _preload_content=False,
                    )
                )

    def delete(self, name: str) -> None:
        job = self.jobs.get(name)
        if job is not None:
            self._ignore_missing(
                functools.partial(
                    self._batch.delete_namespaced_job,
                    name,
                    self.cfg.namespace,
                    propagation_policy="Background",
                    _preload_content=False,
                )
            )
            self.jobs.forget(job)
            if json.loads(job["metadata"]["annotations"][SPEC_ANNOTATION]).get("nodes", 1) > 1:
                # Its owner's deletion would take it too, but not before the garbage collector gets to it.
                self._ignore_missing(
                    functools.partial(
                        self._core.delete_namespaced_service, name, self.cfg.namespace, _preload_content=False
                    )
                )
        for pod in [p for p in self.pods.snapshot() if p["metadata"]["labels"].get(POD_LABEL) == name]:
            pod_name = pod["metadata"]["name"]
            # Off with the finalizer, then a delete without grace: gone at once, killed if it ran.
            self._ignore_missing(
                functools.partial(
                    self._core.patch_namespaced_pod,
                    pod_name,
                    self.cfg.namespace,
                    {"metadata": {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}},
                    _content_type="application/strategic-merge-patch+json",
                    _preload_content=False,
                )
            )
            self._ignore_missing(
                functools.partial(
                    self._core.delete_namespaced_pod,
                    pod_name,
                    self.cfg.namespace,
                    grace_period_seconds=0,
                    _preload_content=False,
                )
            )
            self.pods.forget(pod)

    def logs(self, name: str, tail: int = 100) -> str:
        check_pod_name(name)
        candidates = sorted(
            (p for p in self.pods.snapshot() if p["metadata"]["labels"].get(POD_LABEL) == name),
            key=lambda p: (p["metadata"]["creationTimestamp"], not pod_ended(p)),
        )
        if not candidates:
            if self.jobs.get(name) is not None:
                return ""  # the Job controller has not created its pod yet
            raise PodNotFoundError(f"no pod {name!r} in namespace {self.cfg.namespace}")
        if tail <= 0:
            return ""
        try:
            response = self._core.read_namespaced_pod_log(
                candidates[-1]["metadata"]["name"],
                self.cfg.namespace,
                container=CONTAINER,
                tail_lines=tail,
                _preload_content=False,
            )
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

    def _node_metadata(self, node: str) -> dict[str, Any]:
        if not self.cfg.read_nodes:
            return {}
        if node not in self._nodes:
            try:
                found = self._read(self._core.read_node(node, _preload_content=False))
            except ApiException as e:
                if e.status != 404:
                    raise
                return {}  # the node has gone (a reclaimed spot machine): what was asked stands
            self._nodes[node] = found["metadata"]
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
