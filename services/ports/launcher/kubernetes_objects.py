"""The objects the Kubernetes launcher writes and reads: a training pod's Job (an Indexed Job and
its headless Service for one of several nodes) and a rollout pod's Pod (manifests from a
``PodSpec`` and the ``KubernetesConfig``), and a ``PodStatus`` from a Job or Pod and its pods. Pure functions of their arguments: what the chart and the launcher's
tests check without a server (services/ports/launcher/kubernetes_launcher.py says why each field is set).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

from services.ports.launcher.launcher import (
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    NODE_RANK_ENV,
    PodPhase,
    PodSpec,
    PodStatus,
)

FINALIZER = "spotrl.dev/reap"
MANAGED_BY = {"app.kubernetes.io/managed-by": "spotrl"}
SELECTOR = "app.kubernetes.io/managed-by=spotrl"
POD_LABEL = "spotrl.dev/pod"  # the launcher's pod name, on the Job and on each of its pods
SPEC_ANNOTATION = "spotrl.dev/spec"  # run, role, asked instance and capacity type, the spec's labels (JSON)
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
ZONE_LABEL = "topology.kubernetes.io/zone"
CONTAINER = "main"
# The providers' labels of spot capacity; a node carries at most one provider's.
SPOT_LABELS = {
    "karpenter.sh/capacity-type": "spot",
    "eks.amazonaws.com/capacityType": "SPOT",
    "cloud.google.com/gke-spot": "true",
}
# The taint GKE's documentation gives spot node pools (and its node auto-provisioning may put on
# the spot nodes it creates), so that only pods meant for spot land there. Karpenter and EKS
# managed node groups taint no spot node of their own accord. A toleration draws no pod to spot: the capacity affinity
# (_capacity_terms) keeps an on-demand pod off a spot node whatever it tolerates.
GKE_SPOT_TOLERATION = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}


# Settings that may carry a password: the backends' URLs, and any named as a secret (Kafka's
# SPOTRL_KAFKA_SASL_PLAIN_PASSWORD). With env_secrets they reach pods from those Secrets only.
SECRET_SETTINGS = frozenset({"SPOTRL_STATE_URL", "SPOTRL_QUEUE_URL", "SPOTRL_REWARD_CACHE_URL"})
SECRET_NAME = re.compile("PASSWORD|SECRET|TOKEN")
CATALOG_VOLUME = "price-catalog"
ROLES = ("rollout", "training", "reward")  # each role's pods run on its own pool
# The port a run's reward server (role reward) listens on, at its pod's address.
REWARD_PORT = 8100
# The port node 0 of a training job of several nodes serves their rendezvous on (torchrun's default).
RENDEZVOUS_PORT = 29500
# Each pod of an Indexed Job carries its index here (its node's rank), as the Job controller sets it.
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# What a pod may write under its read-only root filesystem, each an emptyDir: scratch space
# (/tmp: torch's compile caches), the images' home (HF_HOME's model cache, compiled kernels,
# SPOTRL_HOME; docker/*.Dockerfile), and /dev/shm, in memory: NCCL's intra-node transport between
# torchrun's ranks, vLLM's workers and DataLoader workers pass tensors there, and a container's
# own /dev/shm is 64 MiB.
HOME_DIR = "/home/spotrl"
WRITABLE = {"tmp": "/tmp", "home": HOME_DIR, "dshm": "/dev/shm"}
# The size of an instance type the price catalog gives none for: the smallest GPU machines'
# (g4dn/g5/g6.xlarge, g2-standard-4). Name its vcpus and memory_gib in the catalog instead.
DEFAULT_VCPUS, DEFAULT_MEMORY_GIB = 4, 16.0


@dataclass(frozen=True)
class Machine:
    """What a pod is sized by: its instance type's GPUs, vCPUs and memory, as the price catalog
    has them (None where it does not say). A pod takes all the GPUs, or the ``PodSpec.gpus`` it
    asks for (a rollout worker's ``rollout.gpus_per_worker``), and that share of the rest."""

    gpus: int
    vcpus: int | None = None
    memory_gib: float | None = None


def _pool_tolerations(pool: str, *extra: dict[str, str]) -> list[dict[str, Any]]:
    """The pool's taint (so that only spotrl's pods land there) and the GPU nodes' usual one."""
    return [
        {"key": "spotrl.dev/pool", "operator": "Equal", "value": pool, "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        *extra,
    ]


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
    node_selectors: dict[str, dict[str, str]] = field(
        default_factory=lambda: {role: {"spotrl.dev/pool": role} for role in ROLES}
    )
    tolerations: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {
            "rollout": _pool_tolerations("rollout", GKE_SPOT_TOLERATION),
            "training": _pool_tolerations("training", GKE_SPOT_TOLERATION),
            "reward": _pool_tolerations("reward"),
        }
    )
    # AWS's two-minute interruption notice: the grace period of every pod but an on-demand training
    # one (a rollout worker hands back its batch in it, a spot training job writes its checkpoint).
    spot_notice_s: int = 120
    # An on-demand training pod's grace period: its SIGTERM is a drain or an eviction (rare there),
    # with no reclaimed machine behind it.
    training_grace_s: int = 60
    training_deadline_s: int = 6 * 3600  # activeDeadlineSeconds of a training Job
    # Failures of the job's own (a preemption is not one: pod_failure_policy) before the Job fails;
    # the scheduler retries a failed job as a new Job after its own backoff, so none here.
    backoff_limit: int = 0
    ttl_after_finished_s: int = 24 * 3600
    # Each pod requests this share of its instance type's vCPUs and memory (its GPUs: all of them,
    # requested and limited). Requests make it Burstable, not BestEffort, which the kubelet evicts
    # first under memory pressure, and rank it by its use above them; half the machine leaves room
    # below the node's allocatable for the kubelet's and system's reservations and the DaemonSets
    # (GPU device plugin, exporters, CNI), so that the pod still fits its node. No CPU or memory
    # limit: the pod is the node's only workload and may use the rest.
    request_fraction: float = 0.5
    shm_fraction: float = 0.25  # of the instance type's memory: the size limit of the pod's /dev/shm
    # Pod Security Standards' "restricted" profile: a non-root user (the images' 10001, its group
    # the same number), no privilege escalation, no capabilities, the runtime's seccomp profile; and
    # a read-only root filesystem (WRITABLE is what the pod may write), unless an image needs one.
    run_as_user: int = 10001
    read_only_root: bool = True
    # Read each pod's node's labels (its instance type and capacity type); False: what the pod asked
    # for stands, for an identity that may not read nodes (the chart's uninstall hook).
    read_nodes: bool = True


def machine_from_catalog(instance_type: str) -> Machine:
    from services.ports.prices.catalog import load_catalog

    price = load_catalog().get(instance_type)
    return Machine(gpus=price.gpus, vcpus=price.vcpus, memory_gib=price.memory_gib)


def inherited_env() -> dict[str, str]:
    """The launcher's own SPOTRL_* settings (backends' URLs, Kafka and pod settings) for its pods, but
    not the launcher's: a pod launches nothing, and so opens no Kubernetes client."""
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith("SPOTRL_") and k != "SPOTRL_LAUNCHER" and not k.startswith("SPOTRL_KUBE_")
    }


# --- manifests: pure functions of the spec ----------------------------------------------------


def pod_manifest(spec: PodSpec, cfg: KubernetesConfig, machine: Machine, env: dict[str, str]) -> dict[str, Any]:
    """A rollout pod: a bare Pod named after the spec, on the spot (or on-demand) rollout pool."""
    return {"apiVersion": "v1", "kind": "Pod", **_template(spec, cfg, machine, env)}


def job_manifest(spec: PodSpec, cfg: KubernetesConfig, machine: Machine, env: dict[str, str]) -> dict[str, Any]:
    """A training pod: a Job on the training pool, on-demand or spot as the spec asks, of one pod,
    or of one pod per node (``spec.nodes``): an Indexed Job, each pod's index its node's rank, its
    hostname ``<job>-<index>`` under the Job's headless Service (``service_manifest``), node 0's
    the rendezvous (``cli_command``)."""
    template = _template(spec, cfg, machine, env)
    pod = template["spec"]
    if spec.nodes > 1:
        pod["subdomain"] = spec.name
        pod["containers"][0]["env"] += [
            {
                "name": NODE_RANK_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}},
            },
            {"name": MASTER_ADDR_ENV, "value": f"{spec.name}-0.{spec.name}"},
            {"name": MASTER_PORT_ENV, "value": str(RENDEZVOUS_PORT)},
        ]
        pod["containers"][0]["ports"] = [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {k: v for k, v in template["metadata"].items() if k != "finalizers"},
        "spec": {
            "completions": spec.nodes,
            "parallelism": spec.nodes,
            **({"completionMode": "Indexed"} if spec.nodes > 1 else {}),
            # A node's pod started again could not rejoin the others' rendezvous: none is.
            "backoffLimit": cfg.backoff_limit if spec.nodes == 1 else 0,
            "activeDeadlineSeconds": cfg.training_deadline_s,
            "ttlSecondsAfterFinished": cfg.ttl_after_finished_s,
            "podFailurePolicy": pod_failure_policy(spec.capacity_type == "spot" or spec.nodes > 1),
            "template": {
                "metadata": {k: v for k, v in template["metadata"].items() if k != "name"},
                "spec": pod,
            },
        },
    }


def service_manifest(spec: PodSpec, cfg: KubernetesConfig, job_uid: str) -> dict[str, Any]:
    """The headless Service of a training Job of several nodes: DNS names for its pods
    (``<job>-<index>.<job>``, published before they are ready: the rendezvous comes first), owned
    by the Job, so that it goes with it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": spec.name,
            "labels": {**cfg.pod_labels, **MANAGED_BY, POD_LABEL: spec.name, "spotrl.dev/run": spec.run_id},
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": spec.name, "uid": job_uid, "blockOwnerDeletion": True}
            ],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {POD_LABEL: spec.name},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "protocol": "TCP"}],
        },
    }


def pod_failure_policy(fail_job: bool) -> dict[str, Any]:
    """A training Job's ``podFailurePolicy``: what a pod ended by its node's loss (a spot reclaim, a
    drain, an eviction: the ``DisruptionTarget`` condition) does to its Job.

    On-demand, one node: ``Ignore``, the Job makes a new pod, uncounted; its node comes back at
    once. On spot, or of several nodes (``fail_job``): ``FailJob``, the Job ends with its pod,
    reported preempted, and the scheduler relaunches the iteration as a new Job (new ledger
    entries) that resumes from the checkpoint: a pod recreated in the old Job could wait long for
    spot capacity while the Job, and its ledger entries, ran on; and a node recreated alone cannot
    rejoin the others' rendezvous.
    """
    disrupted = [{"type": "DisruptionTarget", "status": "True"}]
    return {"rules": [{"action": "FailJob" if fail_job else "Ignore", "onPodConditions": disrupted}]}


def _template(spec: PodSpec, cfg: KubernetesConfig, machine: Machine, env: dict[str, str]) -> dict[str, Any]:
    # Only an on-demand training pod has the short grace: a pod on spot is given the notice.
    short_grace = spec.role == "training" and spec.capacity_type != "spot"
    # A standby (the scheduler's warm training node) holds a training node: the training pool's everything;
    # an eval pod (a held-out evaluation) runs on the rollout pool, as a bare Pod like a rollout worker.
    pool_role = {"standby": "training", "eval": "rollout"}.get(spec.role, spec.role)
    described = {
        "run_id": spec.run_id,
        "role": spec.role,
        "instance_type": spec.instance_type,
        "capacity_type": spec.capacity_type,
        "labels": spec.labels,
        **({"nodes": spec.nodes} if spec.nodes > 1 else {}),
    }
    labels = {
        **cfg.pod_labels,
        **MANAGED_BY,
        POD_LABEL: spec.name,
        "spotrl.dev/run": spec.run_id,
        "spotrl.dev/role": spec.role,
        **{f"spotrl.dev/{k}": v for k, v in spec.labels.items()},
    }
    command = list(spec.command)
    if command and command[0] == sys.executable:  # the scheduler's interpreter path means nothing in the image
        command[0] = cfg.python
    # The capacity type is each pod's own (the affinity below): a pool's capacity label, such as a
    # rollout pool's karpenter.sh/capacity-type=spot, would leave an on-demand rollout pod no node,
    # and a training pool's karpenter.sh/capacity-type=on-demand a spot training pod.
    # The instance type is the spec's: the one the scheduler bills.
    pool = {k: v for k, v in cfg.node_selectors.get(pool_role, {}).items() if k not in cfg.spot_labels}
    # A pod of some of the node's GPUs (a node of G GPUs holds G / gpus of them) asks for that
    # share of its vCPUs, memory and /dev/shm too, so that they all fit the node.
    gpus = spec.gpus or machine.gpus
    share = gpus / machine.gpus
    gpu = {"nvidia.com/gpu": str(gpus)}
    memory_mib = (machine.memory_gib or DEFAULT_MEMORY_GIB) * 1024 * share
    requests = {
        "cpu": f"{int((machine.vcpus or DEFAULT_VCPUS) * share * cfg.request_fraction * 1000)}m",
        "memory": f"{int(memory_mib * cfg.request_fraction)}Mi",
    }
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": cfg.images.get(
            pool_role, cfg.images.get("rollout", cfg.image) if pool_role == "reward" else cfg.image
        ),
        "command": command,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items()) if not (cfg.env_secrets and _secret(k))],
        "resources": {"requests": {**requests, **gpu}, "limits": gpu},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": cfg.read_only_root,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": name, "mountPath": path} for name, path in WRITABLE.items()],
    }
    if spec.role == "reward":  # it tells the state store its address; rollout workers and eval pods reach it there
        container["env"] += [
            {"name": "SPOTRL_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "SPOTRL_REWARD_PORT", "value": str(REWARD_PORT)},
        ]
        container["ports"] = [{"name": "http", "containerPort": REWARD_PORT, "protocol": "TCP"}]
    if cfg.env_secrets:
        container["envFrom"] = [{"secretRef": {"name": name}} for name in cfg.env_secrets]
    if cfg.image_pull_policy:
        container["imagePullPolicy"] = cfg.image_pull_policy
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": cfg.training_grace_s if short_grace else cfg.spot_notice_s,
        "nodeSelector": {
            **pool,
            INSTANCE_TYPE_LABEL: spec.instance_type,
            **({ZONE_LABEL: spec.zone} if spec.zone is not None else {}),
        },
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": _capacity_terms(spec.capacity_type == "spot", cfg.spot_labels)
                }
            }
        },
        "tolerations": cfg.tolerations.get(pool_role, []),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": cfg.run_as_user,
            "runAsGroup": cfg.run_as_user,
            "fsGroup": cfg.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": "home", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{int(memory_mib * cfg.shm_fraction)}Mi"}},
        ],
    }
    if cfg.service_account:
        pod["serviceAccountName"] = cfg.service_account
    if cfg.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in cfg.image_pull_secrets]
    # The catalog file the pod's settings name (inherited from the launcher's) is where its own pod mounts it.
    if cfg.price_catalog_configmap and (catalog := env.get("SPOTRL_PRICE_CATALOG")):
        pod["volumes"].append({"name": CATALOG_VOLUME, "configMap": {"name": cfg.price_catalog_configmap}})
        container["volumeMounts"].append(
            {"name": CATALOG_VOLUME, "mountPath": str(PurePosixPath(catalog).parent), "readOnly": True}
        )
    metadata = {
        "name": spec.name,
        "labels": labels,
        "finalizers": [FINALIZER],
        "annotations": {SPEC_ANNOTATION: json.dumps(described, sort_keys=True)},
    }
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
    return any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions") or []
    )


def pod_ended(pod: dict[str, Any]) -> bool:
    # A pod deleted before any node took it never runs: nothing will end it but us.
    never_ran = pod["metadata"].get("deletionTimestamp") and not pod["spec"].get("nodeName")
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed") or bool(never_ran)


def status_of(
    obj: dict[str, Any],
    pods: list[dict[str, Any]],
    node_metadata: Callable[[str], dict[str, Any]],
    spot_labels: dict[str, str],
) -> PodStatus:
    """The PodStatus of a bare pod (``pods`` is itself) or of a Job (``pods`` are its pods, oldest
    first). ``node_metadata(name)``: a node's metadata (labels, creationTimestamp), {} if it is gone."""
    described = json.loads(obj["metadata"]["annotations"][SPEC_ANNOTATION])
    latest = _telling(pods)
    terminated = _terminated(latest) if latest else None
    instance_type, capacity_type = described["instance_type"], described["capacity_type"]
    node = latest["spec"].get("nodeName") if latest else None
    labels = node_metadata(node).get("labels", {}) if node else {}
    first_node = next((p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")), None)
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
        elif obj["spec"].get("parallelism") == 0 and all(pod_ended(p) for p in pods):  # stopped
            phase = PodPhase.SUCCEEDED if latest and _exit_code(terminated) == 0 else PodPhase.FAILED
        else:
            phase = PodPhase.RUNNING
        if phase is not PodPhase.RUNNING:
            ended = conditions.get("Complete") or conditions.get("Failed")
            ended_at = _time(obj["status"].get("completionTime")) or (
                ended_at if ended is None else _time(ended["lastTransitionTime"])
            )
    else:
        pod_phase = obj.get("status", {}).get("phase")
        phase = {"Succeeded": PodPhase.SUCCEEDED, "Failed": PodPhase.FAILED}.get(
            pod_phase, PodPhase.FAILED if pod_ended(obj) else PodPhase.RUNNING
        )
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
        waiting_for_node=first_node is None,
        node_joined_at=_time(node_metadata(first_node).get("creationTimestamp")) if first_node else None,
        nodes=described.get("nodes", 1),
        partly_placed=first_node is not None
        and sum(bool(p["spec"].get("nodeName")) for p in _current(pods)) < described.get("nodes", 1),
    )


def _current(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest pod of each index of a Job (``pods`` oldest first): of one that is not Indexed, its latest."""
    return list({p["metadata"].get("annotations", {}).get(INDEX_ANNOTATION): p for p in pods}.values())


def _telling(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The pod whose end tells the Job's (``pods`` oldest first): its latest. A Job of several nodes
    has a latest pod per index; of those, one its node's loss ended, else one that failed (it
    ended the Job, and the others with it), else the latest."""
    ended = [p for p in _current(pods) if pod_ended(p) and p.get("status", {}).get("phase") != "Succeeded"]
    return next((p for p in ended if _disrupted(p)), None) or next(iter(ended), None) or (pods[-1] if pods else None)
