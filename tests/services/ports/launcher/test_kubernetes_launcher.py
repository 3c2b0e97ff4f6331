"""KubernetesLauncher beyond the launcher contract: its manifests (strictly valid for current
Kubernetes versions, which the v1.20 test server cannot check, and admitted by the Pod Security
Standards' restricted profile), each pod's requests and /dev/shm, training Jobs run by the test's
Job controller, spot preemptions, the watches' resumption, secret settings kept out of the pod
specs the server stores, the price catalog's mount, a Job's pod name in the metrics, and its
selection and configuration by settings."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from services.control.api.metrics import RunCollector
from services.core.config import Settings, get_settings
from services.domain.names import rollout_pod_name
from services.ports.launcher.kubernetes_launcher import KubernetesLauncher, Watched
from services.ports.launcher.kubernetes_objects import (
    FINALIZER,
    INDEX_ANNOTATION,
    INSTANCE_TYPE_LABEL,
    KubernetesConfig,
    Machine,
    job_manifest,
    machine_from_catalog,
    pod_manifest,
    service_manifest,
    status_of,
)
from services.ports.launcher.launcher import PodPhase, PodSpec, cli_command
from services.ports.prices.catalog import load_catalog
from services.ports.wiring import open_backends, open_launcher
from tests.app_client import app_client
from tests.pod_security import restricted_violations
from tests.servers.kube import Cluster, KubeServer
from tests.services.ports.launcher.kube_support import launcher_factory
from tests.services.ports.launcher.test_launcher_contract import SLEEPS, wait_for_log, wait_until_ended

# Current versions: what a cluster installed today runs (the schemas kubernetes-validate ships).
CURRENT_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
ROOT = Path(__file__).resolve().parents[4]
CFG = KubernetesConfig(namespace="spotrl", image="registry.example/spotrl-worker:1.0")
# Everything the chart configures: its Secrets, catalog, identity, pull secrets, labels.
CHART_CFG = KubernetesConfig(
    namespace="spotrl",
    images={"rollout": "r.example/spotrl-rollout:2"},
    image_pull_policy="Always",
    image_pull_secrets=("pull",),
    service_account="spotrl-workload",
    env_secrets=("backends",),
    price_catalog_configmap="prices",
    pod_labels={"app.kubernetes.io/instance": "spotrl"},
)
CHART_ENV = {
    "SPOTRL_STATE_URL": "postgresql+psycopg://u:p@db/spotrl",
    "SPOTRL_PRICE_CATALOG": "/etc/spotrl/catalog/catalog.json",
}
G5 = Machine(gpus=1, vcpus=4, memory_gib=16)  # g5.xlarge
P4D = Machine(gpus=8, vcpus=96, memory_gib=1152)  # p4d.24xlarge


def training_spec(
    name: str = "run-1-train-3",
    *,
    command: list[str] | None = None,
    processes: int = 8,
    spot: bool = False,
    nodes: int = 1,
) -> PodSpec:
    return PodSpec(
        name=name,
        run_id="run-1",
        role="training",
        command=command or cli_command(["train-job", "run-1", "3"], processes=processes, nodes=nodes),
        env={"SPOTRL_STATE_URL": "postgresql+psycopg://db/spotrl"},
        instance_type="p4d.24xlarge",
        capacity_type="spot" if spot else "on-demand",
        labels={"iteration": "3"},
        nodes=nodes,
    )


def rollout_spec(name: str = "run-1-rollout-0", *, command: list[str] | None = None, spot: bool = True) -> PodSpec:
    return PodSpec(
        name=name,
        run_id="run-1",
        role="rollout",
        command=command or cli_command(["worker", "run-1", "--worker-id", name]),
        env={},
        instance_type="g5.xlarge",
        capacity_type="spot" if spot else "on-demand",
        labels={"slot": "0"},
    )


def reward_spec() -> PodSpec:
    return PodSpec(
        name="run-1-reward",
        run_id="run-1",
        role="reward",
        command=["python", "-m", "services.cli.main", "reward-pod", "run-1"],
        env={},
        instance_type="g4dn.xlarge",
        capacity_type="on-demand",
    )


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
def open_launcher_on(kube_cluster: Cluster, request: pytest.FixtureRequest) -> Callable[..., KubernetesLauncher]:
    return launcher_factory(kube_cluster, request)


# --- manifests ---------------------------------------------------------------------------------


MANIFESTS = {
    "training-job": job_manifest(training_spec(), CFG, P4D, {}),
    "spot-training-job": job_manifest(training_spec(spot=True), CFG, P4D, {}),
    "spot-rollout-pod": pod_manifest(rollout_spec(), CFG, G5, {"SPOTRL_QUEUE_URL": "kafka://kafka:9092"}),
    "on-demand-rollout-pod": pod_manifest(rollout_spec(spot=False), CFG, G5, {}),
    "chart-training-job": job_manifest(training_spec(), CHART_CFG, P4D, CHART_ENV),
    "multi-node-training-job": job_manifest(training_spec(nodes=4), CFG, P4D, {}),
    "spot-multi-node-training-job": job_manifest(training_spec(nodes=2, spot=True), CHART_CFG, P4D, CHART_ENV),
    "chart-rollout-pod": pod_manifest(rollout_spec(), CHART_CFG, G5, CHART_ENV),
    "reward-server-pod": pod_manifest(reward_spec(), CFG, G5, {}),
    "two-gpu-rollout-pod": pod_manifest(dataclasses.replace(rollout_spec(), gpus=2), CFG, P4D, {}),
}


# The headless Service of a multi-node training Job (its pods' DNS names), besides the pods.
SERVICES = {"multi-node-training-service": service_manifest(training_spec(nodes=4), CHART_CFG, "a-job-uid")}


@pytest.mark.parametrize("version", CURRENT_VERSIONS)
@pytest.mark.parametrize("manifest", [*MANIFESTS.values(), *SERVICES.values()], ids=[*MANIFESTS, *SERVICES])
def test_every_manifest_is_strictly_valid_for_current_kubernetes(manifest: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(manifest, version, strict=True)  # raises ValidationError


@pytest.mark.parametrize("manifest", MANIFESTS.values(), ids=MANIFESTS.keys())
def test_every_pod_is_admitted_by_the_restricted_pod_security_standard(manifest: dict[str, Any]) -> None:
    pod = manifest["spec"]["template"] if manifest["kind"] == "Job" else manifest
    assert restricted_violations(pod) == []
    (container,) = pod["spec"]["containers"]
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001  # the images' user: runAsNonRoot needs a uid to check
    # A read-only root; what the pod writes goes to emptyDirs: scratch, the images' home (model cache), /dev/shm.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert all("emptyDir" in mounts[path] for path in ("/tmp", "/home/spotrl", "/dev/shm"))


def test_the_restricted_check_finds_what_the_standard_forbids() -> None:
    """The check above, on a pod that breaks each control of the profile once."""
    pod = {
        "metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/main": "unconfined"}},
        "spec": {
            "hostNetwork": True,
            "hostPID": False,
            "securityContext": {
                "runAsUser": 0,
                "seccompProfile": {"type": "Unconfined"},
                "sysctls": [{"name": "kernel.msgmax", "value": "1"}, {"name": "net.ipv4.tcp_syncookies", "value": "1"}],
            },
            "volumes": [{"name": "host", "hostPath": {"path": "/"}}, {"name": "scratch", "emptyDir": {}}],
            "containers": [
                {
                    "name": "main",
                    "ports": [{"containerPort": 80, "hostPort": 80}],
                    "securityContext": {
                        "privileged": True,
                        "capabilities": {"add": ["SYS_ADMIN", "NET_BIND_SERVICE"]},
                        "seLinuxOptions": {"type": "spc_t"},
                        "procMount": "Unmasked",
                    },
                }
            ],
            "initContainers": [
                {
                    "name": "init",
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "runAsNonRoot": True,
                        "seccompProfile": {"type": "RuntimeDefault"},
                        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                    },
                }
            ],
        },
    }
    # The init container sets each of its own right: none of its fields is named.
    assert set(restricted_violations(pod)) == {
        "metadata.annotations[container.apparmor.security.beta.kubernetes.io/main]",
        "spec.hostNetwork",
        "spec.securityContext.runAsUser",
        "spec.securityContext.seccompProfile.type",
        "spec.securityContext.sysctls[kernel.msgmax]",
        "spec.volumes[host].hostPath",
        "spec.containers[main].ports[0].hostPort",
        "spec.containers[main].securityContext.privileged",
        "spec.containers[main].securityContext.capabilities.add",
        "spec.containers[main].securityContext.capabilities.drop",
        "spec.containers[main].securityContext.seLinuxOptions.type",
        "spec.containers[main].securityContext.procMount",
        "spec.containers[main].securityContext.allowPrivilegeEscalation",
        "spec.containers[main].securityContext.runAsNonRoot",
        "spec.containers[main].securityContext.seccompProfile.type",
    }


def test_each_pod_requests_a_share_of_its_machine_and_gets_a_memory_backed_shm() -> None:
    job = job_manifest(training_spec(), CFG, P4D, {})["spec"]["template"]["spec"]
    (container,) = job["containers"]
    # Half its 96 vCPUs and 1152 GiB: Burstable, not BestEffort; all 8 GPUs, requested and limited.
    assert container["resources"] == {
        "requests": {"cpu": "48000m", "memory": "589824Mi", "nvidia.com/gpu": "8"},
        "limits": {"nvidia.com/gpu": "8"},
    }
    # torchrun's 8 ranks talk over NCCL's shared memory: /dev/shm in memory, up to a quarter of the machine's.
    (shm,) = [v for v in job["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "294912Mi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # Where the catalog gives no size: the smallest GPU machine's, 4 vCPUs and 16 GiB; the fractions are settings.
    pod = pod_manifest(rollout_spec(), KubernetesConfig(request_fraction=0.25, shm_fraction=0.5), Machine(gpus=1), {})[
        "spec"
    ]
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": "1000m", "memory": "4096Mi", "nvidia.com/gpu": "1"}
    assert [v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "dshm"] == ["8192Mi"]
    # The launcher sizes a pod by the price catalog's entry of its instance type.
    assert (machine_from_catalog("p4d.24xlarge"), machine_from_catalog("g5.xlarge")) == (P4D, G5)


def test_a_training_job_manifest() -> None:
    job = job_manifest(training_spec(), CFG, P4D, {"SPOTRL_STATE_URL": "postgresql+psycopg://db/spotrl"})
    spec, pod = job["spec"], job["spec"]["template"]["spec"]

    assert job["metadata"]["name"] == "run-1-train-3"  # deterministic: a retried launch finds it
    assert job["metadata"]["labels"]["spotrl.dev/run"] == "run-1"
    assert spec["podFailurePolicy"] == {
        "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    }
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) == (
        0,
        6 * 3600,
        86400,
    )
    assert pod["restartPolicy"] == "Never"  # what podFailurePolicy requires
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge", "spotrl.dev/pool": "training"}
    assert {"key": "spotrl.dev/pool", "operator": "Equal", "value": "training", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    # torchrun starts the 8 ranks; the image's python runs it, not the scheduler's interpreter.
    assert container["command"][:5] == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert {"name": "SPOTRL_STATE_URL", "value": "postgresql+psycopg://db/spotrl"} in container["env"]
    # On-demand: no spot label of any provider may match.
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(e["operator"] == "NotIn" for e in term["matchExpressions"])


def test_a_multi_node_training_job_is_an_indexed_job_whose_nodes_meet_at_node_0() -> None:
    job = job_manifest(training_spec(nodes=4), CFG, P4D, {})
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    # One pod per node, all at once; the pod's index is its node's rank.
    assert (spec["completions"], spec["parallelism"], spec["completionMode"]) == (4, 4, "Indexed")
    # Any pod's failure or its node's loss ends the Job: a node started again alone cannot rejoin.
    assert spec["backoffLimit"] == 0
    assert (
        job_manifest(training_spec(nodes=4), dataclasses.replace(CFG, backoff_limit=3), P4D, {})["spec"]["backoffLimit"]
        == 0
    )
    assert spec["podFailurePolicy"]["rules"][0]["action"] == "FailJob"  # on-demand too
    (container,) = pod["containers"]
    assert container["command"][:7] == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes=4",
        "--rdzv-backend=static",
        "--rdzv-conf=timeout=1800",
        "--nproc_per_node=8",
    ]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["PET_NODE_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    # Node 0's hostname under the Job's headless Service of the same name.
    assert (pod["subdomain"], env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"]) == (
        "run-1-train-3",
        "run-1-train-3-0.run-1-train-3",
        "29500",
    )
    service = service_manifest(training_spec(nodes=4), CFG, "uid-1")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"spotrl.dev/pod": "run-1-train-3"}
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert service["metadata"]["ownerReferences"][0] | {"uid": "uid-1"} == service["metadata"]["ownerReferences"][0]
    # One node: the Job of one pod it was.
    single = job_manifest(training_spec(), CFG, P4D, {})["spec"]
    assert "completionMode" not in single and "subdomain" not in single["template"]["spec"]


GKE_SPOT_TAINT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    return any(
        t["key"] == taint["key"]
        and t.get("effect") in (None, taint["effect"])
        and (t["operator"] == "Exists" or t.get("value") == taint["value"])
        for t in tolerations
    )


def matches(terms: list[dict[str, Any]], labels: dict[str, str]) -> bool:
    """Whether a node with ``labels`` satisfies required node selector terms (ORed; expressions ANDed)."""
    ops = {"In": lambda k, v: labels.get(k) in v, "NotIn": lambda k, v: labels.get(k) not in v}
    return any(all(ops[e["operator"]](e["key"], e["values"]) for e in t["matchExpressions"]) for t in terms)


def test_a_spot_training_job_manifest() -> None:
    """On spot: the spot nodes of the training pool, the spot notice to checkpoint in, and a
    disruption that ends the Job (FailJob) instead of a pod recreated inside it (Ignore)."""
    # The chart's Karpenter settings: the training pool's selector carries its on-demand label.
    cfg = KubernetesConfig(
        spot_labels={"karpenter.sh/capacity-type": "spot"},
        node_selectors={"training": {"spotrl.dev/pool": "training", "karpenter.sh/capacity-type": "on-demand"}},
    )
    on_demand, spot = (job_manifest(training_spec(spot=s), cfg, P4D, {})["spec"] for s in (False, True))
    disrupted = [{"type": "DisruptionTarget", "status": "True"}]
    assert on_demand["podFailurePolicy"] == {"rules": [{"action": "Ignore", "onPodConditions": disrupted}]}
    assert spot["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onPodConditions": disrupted}]}
    assert spot["backoffLimit"] == on_demand["backoffLimit"] == 0
    on_demand_pod, spot_pod = on_demand["template"]["spec"], spot["template"]["spec"]
    assert (on_demand_pod["terminationGracePeriodSeconds"], spot_pod["terminationGracePeriodSeconds"]) == (60, 120)
    # The pool's capacity label is dropped: each pod's capacity is its affinity's.
    for pod in (on_demand_pod, spot_pod):
        assert pod["nodeSelector"] == {"spotrl.dev/pool": "training", INSTANCE_TYPE_LABEL: "p4d.24xlarge"}
        assert pod["tolerations"] == spot_pod["tolerations"]

    def terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
        return pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]

    assert terms(spot_pod) == [
        {"matchExpressions": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}]}
    ]
    # Each provider's spot and on-demand training nodes, with the default settings: a spot pod takes
    # only the spot ones (GKE's tainted, as its spot node pools are), an on-demand pod only the others.
    defaults = KubernetesConfig()
    on_demand_pod, spot_pod = (
        job_manifest(training_spec(spot=s), defaults, P4D, {})["spec"]["template"]["spec"] for s in (False, True)
    )
    nodes = {
        "karpenter": ({"karpenter.sh/capacity-type": "spot"}, {"karpenter.sh/capacity-type": "on-demand"}),
        "eks-node-group": ({"eks.amazonaws.com/capacityType": "SPOT"}, {"eks.amazonaws.com/capacityType": "ON_DEMAND"}),
        "gke": ({"cloud.google.com/gke-spot": "true"}, {}),
    }
    pool_taint = {"key": "spotrl.dev/pool", "value": "training", "effect": "NoSchedule"}
    for provider, (spot_labels, on_demand_labels) in nodes.items():
        spot_taints = [pool_taint, GKE_SPOT_TAINT] if provider == "gke" else [pool_taint]
        assert matches(terms(spot_pod), spot_labels) and not matches(terms(spot_pod), on_demand_labels), provider
        assert matches(terms(on_demand_pod), on_demand_labels) and not matches(terms(on_demand_pod), spot_labels)
        assert all(tolerates(spot_pod["tolerations"], t) for t in spot_taints), provider
    assert spot_pod["nodeSelector"] == {"spotrl.dev/pool": "training", INSTANCE_TYPE_LABEL: "p4d.24xlarge"}


def test_a_spot_rollout_pod_manifest() -> None:
    cfg = KubernetesConfig(spot_labels={"karpenter.sh/capacity-type": "spot", "example.com/pool": "cheap"})
    pod = pod_manifest(rollout_spec(), cfg, G5, {})

    assert pod["metadata"]["name"] == "run-1-rollout-0" and pod["metadata"]["finalizers"] == [FINALIZER]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120  # the spot notice
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [  # ORed: any one provider's spot label
        {"matchExpressions": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}]},
        {"matchExpressions": [{"key": "example.com/pool", "operator": "In", "values": ["cheap"]}]},
    ]
    assert pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "1"


def test_a_rollout_pod_of_some_of_its_nodes_gpus_asks_for_them_and_that_share_of_the_rest() -> None:
    # rollout.gpus_per_worker 2 on an 8-GPU node: 4 workers per node, each a quarter of its
    # 96 vCPUs and 1152 GiB (half of that requested), and of its /dev/shm.
    pod = pod_manifest(dataclasses.replace(rollout_spec(), gpus=2), CFG, P4D, {})["spec"]
    (container,) = pod["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "12000m", "memory": "147456Mi", "nvidia.com/gpu": "2"},
        "limits": {"nvidia.com/gpu": "2"},
    }
    assert [v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "dshm"] == ["73728Mi"]
    # Four such pods fit the node's requests where one whole-node pod did.
    whole = pod_manifest(rollout_spec(), CFG, P4D, {})["spec"]["containers"][0]["resources"]["requests"]
    assert (int(whole["cpu"][:-1]), int(whole["memory"][:-2])) == (4 * 12000, 4 * 147456)


def test_a_rollout_pod_asks_the_api_server_for_its_workers_gpus(
    open_launcher_on: Callable[..., KubernetesLauncher], kube_cluster: Cluster
) -> None:
    launcher = open_launcher_on()
    four_gpus = dataclasses.replace(rollout_spec("r-gpus", command=python("pass")), instance_type="ecs.gn7i-4x.8xlarge")
    launcher.launch(dataclasses.replace(four_gpus, gpus=2))
    launcher.launch(dataclasses.replace(four_gpus, name="r-node"))  # no gpus: the node's four
    for name, gpus in (("r-gpus", "2"), ("r-node", "4")):
        (container,) = read_back(kube_cluster, "Pod", name)["spec"]["containers"]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": gpus}, name
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus, name
    # The catalog gives no size for ecs.gn7i-4x.8xlarge: half of the default 4 vCPUs and 16 GiB, half requested.
    (container,) = read_back(kube_cluster, "Pod", "r-gpus")["spec"]["containers"]
    assert (container["resources"]["requests"]["cpu"], container["resources"]["requests"]["memory"]) == (
        "1",
        "4Gi",
    )


def test_each_role_has_its_image_and_pool_and_the_pod_its_own_capacity_type() -> None:
    cfg = KubernetesConfig(
        images={"rollout": "r.example/spotrl-rollout:2"},
        node_selectors={"rollout": {"spotrl.dev/pool": "rollout", "karpenter.sh/capacity-type": "spot"}},
        tolerations={"rollout": [{"key": "spot", "operator": "Exists"}]},
        pod_labels={"app.kubernetes.io/instance": "spotrl", "spotrl.dev/run": "not-this"},
    )
    pod = pod_manifest(rollout_spec(spot=False), cfg, G5, {})
    # The pool's spot label would leave an on-demand pod no node: its capacity is its affinity's.
    assert pod["spec"]["nodeSelector"] == {
        "spotrl.dev/pool": "rollout",
        "node.kubernetes.io/instance-type": "g5.xlarge",
    }
    assert pod["spec"]["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert pod["spec"]["containers"][0]["image"] == "r.example/spotrl-rollout:2"
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "spotrl"
    assert pod["metadata"]["labels"]["spotrl.dev/run"] == "run-1"  # the launcher's own labels win
    assert (
        job_manifest(training_spec(), cfg, P4D, {})["spec"]["template"]["spec"]["containers"][0]["image"] == cfg.image
    )
    # No Secrets named: the values are the pod's (a development cluster).
    (container,) = pod_manifest(rollout_spec(), cfg, G5, {"SPOTRL_QUEUE_URL": "kafka://k:9092"})["spec"]["containers"]
    assert container["env"] == [{"name": "SPOTRL_QUEUE_URL", "value": "kafka://k:9092"}] and "envFrom" not in container


def test_a_worker_or_spot_job_of_a_zone_is_held_to_that_zone() -> None:
    cfg = KubernetesConfig(node_selectors={"rollout": {"spotrl.dev/pool": "rollout"}})
    zoned = dataclasses.replace(rollout_spec(), zone="us-central1-b")
    assert pod_manifest(zoned, cfg, G5, {})["spec"]["nodeSelector"] == {
        "spotrl.dev/pool": "rollout",
        "node.kubernetes.io/instance-type": "g5.xlarge",
        "topology.kubernetes.io/zone": "us-central1-b",
    }
    assert "topology.kubernetes.io/zone" not in pod_manifest(rollout_spec(), cfg, G5, {})["spec"]["nodeSelector"]
    # A spot training job of a zone (training.spot_zones) likewise.
    training = dataclasses.replace(training_spec(spot=True), zone="us-central1-b")
    selector = job_manifest(training, cfg, P4D, {})["spec"]["template"]["spec"]["nodeSelector"]
    assert selector["topology.kubernetes.io/zone"] == "us-central1-b"


def test_a_standby_holds_a_node_of_the_training_pool() -> None:
    cfg = KubernetesConfig(
        images={"training": "r.example/spotrl-training:2"}, node_selectors={"training": {"spotrl.dev/pool": "training"}}
    )
    standby = PodSpec(
        name="run-1-warm-2",
        run_id="run-1",
        role="standby",
        command=["python", "-m", "services.control.scheduler.standby"],
        env={},
        instance_type="p4d.24xlarge",
        capacity_type="on-demand",
        labels={"after_iteration": "2"},
    )
    pod = pod_manifest(standby, cfg, P4D, {})
    assert pod["spec"]["nodeSelector"] == {
        "spotrl.dev/pool": "training",
        "node.kubernetes.io/instance-type": "p4d.24xlarge",
    }
    assert pod["spec"]["containers"][0]["image"] == "r.example/spotrl-training:2"
    assert pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"  # the node's GPUs, held


def test_a_runs_reward_server_runs_on_the_reward_pool_and_says_its_address() -> None:
    pod = pod_manifest(reward_spec(), KubernetesConfig(images={"rollout": "r.example/spotrl-rollout:2"}), G5, {})
    assert pod["spec"]["nodeSelector"] == {
        "spotrl.dev/pool": "reward",
        "node.kubernetes.io/instance-type": "g4dn.xlarge",
    }
    assert {"key": "spotrl.dev/pool", "operator": "Equal", "value": "reward", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]
    [container] = pod["spec"]["containers"]
    assert container["image"] == "r.example/spotrl-rollout:2"  # no reward image of its own: the rollout image
    assert {"name": "SPOTRL_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert {"name": "SPOTRL_REWARD_PORT", "value": "8100"} in container["env"]
    assert container["ports"] == [{"name": "http", "containerPort": 8100, "protocol": "TCP"}]
    users = KubernetesConfig(images={"rollout": "r.example/spotrl-rollout:2", "reward": "users.example/rewards:7"})
    assert pod_manifest(reward_spec(), users, G5, {})["spec"]["containers"][0]["image"] == "users.example/rewards:7"


def test_an_eval_pod_runs_on_the_rollout_pool() -> None:
    cfg = KubernetesConfig(
        images={"rollout": "r.example/spotrl-rollout:2"},
        node_selectors={"rollout": {"spotrl.dev/pool": "rollout"}},
        tolerations={"rollout": [{"key": "spot", "operator": "Exists"}]},
    )
    evaluation = PodSpec(
        name="run-1-eval-2",
        run_id="run-1",
        role="eval",
        command=["python", "-m", "services.cli.main", "eval-job"],
        env={},
        instance_type="g5.xlarge",
        capacity_type="spot",
        labels={"version": "2"},
    )
    pod = pod_manifest(evaluation, cfg, G5, {})
    assert pod["spec"]["nodeSelector"] == {
        "spotrl.dev/pool": "rollout",
        "node.kubernetes.io/instance-type": "g5.xlarge",
    }
    assert pod["spec"]["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert pod["spec"]["containers"][0]["image"] == "r.example/spotrl-rollout:2"
    assert (
        pod["metadata"]["labels"]["spotrl.dev/role"] == "eval"
        and pod["metadata"]["labels"]["spotrl.dev/version"] == "2"
    )


def node_status(node_labels: dict[str, str], pod_status: dict[str, Any], cfg: KubernetesConfig = CFG) -> Any:
    pod = pod_manifest(rollout_spec(), cfg, G5, {})
    pod["metadata"] |= {"creationTimestamp": "2026-12-01T10:00:00Z", "uid": "u"}
    pod["spec"]["nodeName"] = "node-a"
    pod["status"] = pod_status
    return status_of(pod, [pod], lambda node: {"labels": node_labels}, cfg.spot_labels)


def test_the_node_labels_give_instance_and_capacity_type() -> None:
    running = {"phase": "Running", "startTime": "2026-12-01T10:00:05Z"}
    eks_spot = node_status(
        {"node.kubernetes.io/instance-type": "g6.xlarge", "eks.amazonaws.com/capacityType": "SPOT"}, running
    )
    assert (eks_spot.instance_type, eks_spot.capacity_type, eks_spot.phase) == ("g6.xlarge", "spot", PodPhase.RUNNING)
    gke = node_status(
        {"node.kubernetes.io/instance-type": "g2-standard-4", "cloud.google.com/gke-spot": "true"}, running
    )
    assert gke.capacity_type == "spot"
    on_demand = node_status(
        {"node.kubernetes.io/instance-type": "g5.xlarge", "karpenter.sh/capacity-type": "on-demand"}, running
    )
    assert on_demand.capacity_type == "on-demand"
    assert on_demand.started_at == 1796119205.0  # status.startTime


def test_a_pod_ended_by_a_disruption_is_preempted_and_a_signal_death_is_negative() -> None:
    ended = {
        "phase": "Failed",
        "startTime": "2026-12-01T10:00:05Z",
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}],
        "containerStatuses": [
            {"name": "main", "state": {"terminated": {"exitCode": 143, "finishedAt": "2026-12-01T10:07:00Z"}}}
        ],
    }
    pod = node_status({"node.kubernetes.io/instance-type": "g5.xlarge"}, ended)
    assert (pod.phase, pod.preempted, pod.exit_code, pod.ended_at) == (
        PodPhase.FAILED,
        True,
        -signal.SIGTERM,
        1796119620.0,
    )

    ended["conditions"] = []
    assert node_status({}, ended).preempted is False


def job_status(spec: PodSpec, job_conditions: list[dict[str, str]], pod_status: dict[str, Any]) -> Any:
    """The PodStatus of a training Job of one pod, on a Karpenter node of the spec's capacity type."""
    job = job_manifest(spec, CFG, P4D, {})
    job["metadata"] |= {"creationTimestamp": "2026-12-01T10:00:00Z", "uid": "j"}
    job["status"] = {"startTime": "2026-12-01T10:00:01Z", "conditions": job_conditions}
    pod = {
        "metadata": {"name": f"{spec.name}-x1y2z", "creationTimestamp": "2026-12-01T10:00:01Z", "uid": "p"},
        "spec": {**job["spec"]["template"]["spec"], "nodeName": "node-a"},
        "status": pod_status,
    }
    labels = {INSTANCE_TYPE_LABEL: spec.instance_type, "karpenter.sh/capacity-type": spec.capacity_type}
    return status_of(job, [pod], lambda node: {"labels": labels}, CFG.spot_labels)


def test_a_spot_training_job_failed_by_its_pods_disruption_is_preempted() -> None:
    """FailJob ends the Job with the Failed condition (reason PodFailurePolicy); its pod carries
    DisruptionTarget: preempted, as the scheduler's relaunch and the ledger's outcome need."""
    reclaimed = {
        "phase": "Failed",
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}],
        "containerStatuses": [
            {"name": "main", "state": {"terminated": {"exitCode": 143, "finishedAt": "2026-12-01T10:30:00Z"}}}
        ],
    }
    failed = {
        "type": "Failed",
        "status": "True",
        "reason": "PodFailurePolicy",
        "lastTransitionTime": "2026-12-01T10:30:01Z",
    }
    job = job_status(training_spec(spot=True), [failed], reclaimed)
    assert (job.phase, job.preempted, job.exit_code, job.capacity_type) == (
        PodPhase.FAILED,
        True,
        -signal.SIGTERM,
        "spot",
    )
    assert job.ended_at == 1796121001.0  # the Job's end, the Failed condition's
    # Until the Job controller has failed the Job, it runs, whatever its pod did.
    assert job_status(training_spec(spot=True), [], reclaimed).phase is PodPhase.RUNNING
    # A failure of the job's own is not a preemption.
    crashed = {**reclaimed, "conditions": []}
    failed |= {"reason": "BackoffLimitExceeded"}
    assert job_status(training_spec(spot=True), [failed], crashed).preempted is False


def test_a_multi_node_jobs_status_is_told_by_the_node_that_ended_it() -> None:
    """A node's loss ends the Job (FailJob), and the Job controller then deletes the others: the Job
    reads preempted, with the lost node's exit code, whichever pod is newest."""
    spec = training_spec(nodes=2)
    job = job_manifest(spec, CFG, P4D, {})
    job["metadata"] |= {"creationTimestamp": "2026-12-01T10:00:00Z", "uid": "j"}
    failed = {
        "type": "Failed",
        "status": "True",
        "reason": "PodFailurePolicy",
        "lastTransitionTime": "2026-12-01T10:30:01Z",
    }
    job["status"] = {"startTime": "2026-12-01T10:00:01Z", "conditions": [failed]}

    def pod(index: int, code: int, disrupted: bool) -> dict[str, Any]:
        conditions = [{"type": "DisruptionTarget", "status": "True"}] if disrupted else []
        terminated = {"exitCode": code, "finishedAt": "2026-12-01T10:30:00Z"}
        return {
            "metadata": {
                "name": f"{spec.name}-{index}-x1y2z",
                "creationTimestamp": "2026-12-01T10:00:01Z",
                "annotations": {INDEX_ANNOTATION: str(index)},
            },
            "spec": {**job["spec"]["template"]["spec"], "nodeName": f"node-{index}"},
            "status": {
                "phase": "Failed",
                "conditions": conditions,
                "containerStatuses": [{"state": {"terminated": terminated}}],
            },
        }

    labels = {INSTANCE_TYPE_LABEL: "p4d.24xlarge"}
    lost_first = status_of(job, [pod(0, 143, True), pod(1, 137, False)], lambda n: {"labels": labels}, CFG.spot_labels)
    assert (lost_first.phase, lost_first.preempted, lost_first.exit_code, lost_first.nodes) == (
        PodPhase.FAILED,
        True,
        -signal.SIGTERM,
        2,
    )
    crashed = status_of(job, [pod(0, 137, False), pod(1, 3, False)], lambda n: {"labels": labels}, CFG.spot_labels)
    assert (crashed.preempted, crashed.exit_code) == (False, -signal.SIGKILL)  # the first index that failed
    assert not crashed.partly_placed  # both nodes held it
    # Running, node 1's pod without a node yet: billed (node 0's), not started.
    job["status"] = {"startTime": "2026-12-01T10:00:01Z"}
    waiting = pod(1, 0, False)
    waiting["spec"].pop("nodeName")
    waiting["status"] = {"phase": "Pending"}
    placed = {**pod(0, 0, False), "status": {"phase": "Running"}}
    partly = status_of(job, [placed, waiting], lambda n: {"labels": labels}, CFG.spot_labels)
    assert (partly.phase, partly.waiting_for_node, partly.partly_placed) == (PodPhase.RUNNING, False, True)
    none = status_of(job, [waiting], lambda n: {"labels": labels}, CFG.spot_labels)
    assert (none.waiting_for_node, none.partly_placed) == (True, False)


# --- on the real API server --------------------------------------------------------------------


def test_a_training_job_runs_on_the_training_pool(open_launcher_on: Callable[..., KubernetesLauncher]) -> None:
    launcher = open_launcher_on()
    spec = training_spec("t-ok", command=python("print('trained')"))
    launcher.launch(spec)
    launcher.launch(spec)  # AlreadyExists is success

    pod = wait_until_ended(launcher, "t-ok")

    assert (pod.phase, pod.exit_code, pod.role, pod.labels) == (PodPhase.SUCCEEDED, 0, "training", {"iteration": "3"})
    assert (pod.instance_type, pod.capacity_type) == ("p4d.24xlarge", "on-demand")  # from its node's labels
    assert "trained" in launcher.logs("t-ok")  # the pod log API, through the test's kubelet
    launcher.delete("t-ok")
    assert launcher.list() == []


def test_a_multi_node_training_job_runs_a_pod_per_node_behind_its_service(
    open_launcher_on: Callable[..., KubernetesLauncher], kube_cluster: Cluster
) -> None:
    """The API server takes the Indexed Job and its Service; each node's pod learns its rank from
    its index and node 0's address; the Job ends once every node has; delete takes the Service too."""
    launcher = open_launcher_on()
    code = "import os; print('node', os.environ['PET_NODE_RANK'], 'meets at', os.environ['PET_MASTER_ADDR'])"
    spec = training_spec("t-nodes", command=python(code), nodes=2)
    launcher.launch(spec)
    launcher.launch(spec)  # AlreadyExists is success, the Service's too

    service = read_back(kube_cluster, "Service", "t-nodes")
    job = read_back(kube_cluster, "Job", "t-nodes")
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    pod = wait_until_ended(launcher, "t-nodes")
    assert (pod.phase, pod.exit_code, pod.nodes) == (PodPhase.SUCCEEDED, 0, 2)
    pods = [p for p in launcher.pods.snapshot() if p["metadata"]["labels"]["spotrl.dev/pod"] == "t-nodes"]
    outputs = sorted((kube_cluster.kubelet.dir / f"{p['metadata']['name']}.log").read_text() for p in pods)
    assert outputs == ["node 0 meets at t-nodes-0.t-nodes\n", "node 1 meets at t-nodes-0.t-nodes\n"]
    launcher.delete("t-nodes")
    assert launcher.list() == []
    with pytest.raises(ApiException) as gone:
        read_back(kube_cluster, "Service", "t-nodes")
    assert gone.value.status == 404


def test_the_standby_of_a_multi_node_job_holds_as_many_nodes(
    open_launcher_on: Callable[..., KubernetesLauncher], kube_cluster: Cluster, wait_for
) -> None:
    launcher = open_launcher_on()
    standby = dataclasses.replace(
        training_spec("t-warm", command=python("import time; time.sleep(60)"), nodes=2), role="standby"
    )
    launcher.launch(standby)
    assert read_back(kube_cluster, "Job", "t-warm")["spec"]["parallelism"] == 2
    wait_for(lambda: len(kube_cluster.kubelet.processes) == 2, message="both nodes' pods run")
    (pod,) = launcher.list()
    assert (pod.role, pod.nodes, pod.phase) == ("standby", 2, PodPhase.RUNNING)
    launcher.stop("t-warm", grace_s=0)
    assert wait_until_ended(launcher, "t-warm").exit_code == -signal.SIGTERM  # both nodes stopped


def test_a_failed_node_ends_its_multi_node_job(
    open_launcher_on: Callable[..., KubernetesLauncher], kube_cluster: Cluster
) -> None:
    """Node 1 fails while node 0 still trains: the Job fails at once (backoffLimit 0), node 0's pod
    is ended with it, and the job reads failed with node 1's exit code."""
    launcher = open_launcher_on()
    code = "import os, time; rank = int(os.environ['PET_NODE_RANK']); time.sleep(60) if rank == 0 else exit(3)"
    launcher.launch(training_spec("t-lost", command=python(code), nodes=2))
    pod = wait_until_ended(launcher, "t-lost")
    assert (pod.phase, pod.exit_code, pod.preempted) == (PodPhase.FAILED, 3, False)
    deadline = time.monotonic() + 30
    while any(p.popen.poll() is None for p in kube_cluster.kubelet.processes.values()):
        assert time.monotonic() < deadline, "node 0's pod still runs after its Job failed"
        time.sleep(0.05)


def test_a_failed_training_job_fails_with_the_exit_code(open_launcher_on: Callable[..., KubernetesLauncher]) -> None:
    launcher = open_launcher_on()
    launcher.launch(training_spec("t-bad", command=python("raise SystemExit(3)")))
    pod = wait_until_ended(launcher, "t-bad")
    assert (pod.phase, pod.exit_code, pod.preempted) == (PodPhase.FAILED, 3, False)


def test_a_preempted_on_demand_training_pod_is_retried_by_the_job_not_failed(
    open_launcher_on: Callable[..., KubernetesLauncher], kube_cluster: Cluster, tmp_path: Path, wait_for
) -> None:
    launcher = open_launcher_on()
    # The first pod sleeps until preempted; its successor finds the marker and succeeds.
    marker = tmp_path / "first-ran"
    code = (
        f"import os, time, pathlib; p = pathlib.Path({str(marker)!r})\nif p.exists(): print('second'); raise SystemExit(0)\n"
        "p.touch(); print('ready', flush=True); time.sleep(60)"
    )
    launcher.launch(training_spec("t-spot", command=python(code)))
    wait_for_log(launcher, "t-spot", "ready")
    (first,) = [p["metadata"]["name"] for p in launcher.pods.snapshot()]

    kube_cluster.kubelet.preempt(first)

    pod = wait_until_ended(launcher, "t-spot")
    assert pod.phase is PodPhase.SUCCEEDED  # the preemption did not count as the job's failure
    assert "second" in launcher.logs("t-spot")  # the logs are the latest pod's


def test_a_preempted_spot_training_job_ends_preempted_and_its_relaunch_resumes(
    open_launcher_on: Callable[..., KubernetesLauncher], kube_cluster: Cluster, tmp_path: Path
) -> None:
    """On spot, the pod's disruption ends the Job (FailJob): no pod is recreated inside it to wait
    for capacity while the Job runs on. The scheduler's relaunch, a new Job of the same name after
    the old one is reaped, finds the checkpoint the first pod wrote at its SIGTERM."""
    launcher = open_launcher_on()
    checkpoint = tmp_path / "checkpoint"
    code = (
        f"import pathlib, signal, sys, time; p = pathlib.Path({str(checkpoint)!r})\n"
        "if p.exists(): print('resumed from', p.read_text()); raise SystemExit(0)\n"
        "def stop(*_): p.write_text('step 7'); print('checkpointed', flush=True); sys.exit(128 + signal.SIGTERM)\n"
        "signal.signal(signal.SIGTERM, stop); print('ready', flush=True); time.sleep(60)"
    )
    spec = training_spec("t-spot", command=python(code), spot=True)
    launcher.launch(spec)
    wait_for_log(launcher, "t-spot", "ready")
    (first,) = [p["metadata"]["name"] for p in launcher.pods.snapshot()]
    assert launcher.list()[0].capacity_type == "spot"  # its node's label

    kube_cluster.kubelet.preempt(first)  # the spot notice: DisruptionTarget, then deletion with grace

    pod = wait_until_ended(launcher, "t-spot")
    assert (pod.phase, pod.preempted, pod.exit_code, pod.platform_name) == (
        PodPhase.FAILED,
        True,
        -signal.SIGTERM,
        first,
    )
    assert "checkpointed" in launcher.logs("t-spot")
    # The Job failed for its pod's disruption, and made no second pod: it is over.
    stored = read_back(kube_cluster, "Job", "t-spot")["status"]
    assert [(c["type"], c["reason"]) for c in stored["conditions"]] == [("Failed", "PodFailurePolicy")]
    assert (stored.get("active", 0), stored["failed"]) == (0, 1)  # a zero is left out
    assert [p["metadata"]["name"] for p in launcher.pods.snapshot()] == [first]

    launcher.delete("t-spot")  # reaped, then launched again under the same name: a new Job
    launcher.launch(spec)
    pod = wait_until_ended(launcher, "t-spot")
    assert (pod.phase, pod.preempted, pod.capacity_type) == (PodPhase.SUCCEEDED, False, "spot")
    assert "resumed from step 7" in launcher.logs("t-spot")


def test_stopping_a_training_job_sigterms_its_pod_and_keeps_its_status(
    open_launcher_on: Callable[..., KubernetesLauncher],
) -> None:
    launcher = open_launcher_on()
    launcher.launch(training_spec("t-stop", command=python(SLEEPS)))
    wait_for_log(launcher, "t-stop", "ready")

    launcher.stop("t-stop", grace_s=5)

    pod = wait_until_ended(launcher, "t-stop")
    assert (pod.phase, pod.exit_code) == (PodPhase.FAILED, -signal.SIGTERM)
    assert open_launcher_on().list() == [pod]  # a restarted scheduler sees it ended too
    launcher.delete("t-stop")
    assert launcher.list() == [] and launcher.pods.snapshot() == []


def test_a_preempted_spot_pod_is_reported_preempted(
    open_launcher_on: Callable[..., KubernetesLauncher], kube_cluster: Cluster
) -> None:
    launcher = open_launcher_on()
    launcher.launch(rollout_spec("r-spot", command=python(SLEEPS)))
    wait_for_log(launcher, "r-spot", "ready")
    assert launcher.list()[0].capacity_type == "spot"

    kube_cluster.kubelet.preempt("r-spot")  # the node's spot notice: DisruptionTarget, then deletion

    pod = wait_until_ended(launcher, "r-spot")  # still listed: the finalizer keeps it until reaped
    assert (pod.phase, pod.preempted, pod.exit_code) == (PodPhase.FAILED, True, -signal.SIGTERM)


def test_a_spot_pod_without_capacity_waits_for_a_node_and_then_says_when_its_node_joined(
    open_launcher_on: Callable[..., KubernetesLauncher], kube_cluster: Cluster, wait_for
) -> None:
    launcher = open_launcher_on()
    kube_cluster.kubelet.spot_capacity.clear()  # the zone has none to give
    launched = time.time()
    launcher.launch(rollout_spec("r-wait", command=python(SLEEPS)))
    (waiting,) = wait_for(launcher.list, message="the pod is listed")
    assert (waiting.phase, waiting.waiting_for_node, waiting.node_joined_at) == (PodPhase.RUNNING, True, None)

    kube_cluster.kubelet.spot_capacity.set()  # capacity comes back: a node is made for the pod
    wait_for_log(launcher, "r-wait", "ready")
    placed = wait_for(lambda: [p for p in launcher.list() if not p.waiting_for_node], message="the pod is on a node")[0]
    assert placed.node_joined_at is not None and placed.node_joined_at >= int(
        launched
    )  # the API's stamps are whole seconds
    assert placed.capacity_type == "spot"


def test_pods_inherit_the_launchers_spotrl_settings(
    open_launcher_on: Callable[..., KubernetesLauncher], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTRL_KAFKA_SECURITY_PROTOCOL", "SSL")
    monkeypatch.setenv("SPOTRL_LAUNCHER", "kubernetes")
    monkeypatch.setenv("SPOTRL_KUBE_NAMESPACE", "elsewhere")
    launcher = open_launcher_on()
    launcher.launch(PodSpec("r-env", "run-1", "rollout", python("pass"), {"POD": "x"}, "g5.xlarge", "spot"))

    sent = launcher.pods.get("r-env")
    assert sent is not None
    env = {e["name"]: e["value"] for e in sent["spec"]["containers"][0]["env"]}
    assert (env["SPOTRL_KAFKA_SECURITY_PROTOCOL"], env["POD"]) == ("SSL", "x")
    assert "SPOTRL_LAUNCHER" not in env and "SPOTRL_KUBE_NAMESPACE" not in env  # a pod launches nothing


def test_the_watch_resumes_from_its_version_and_lists_again_only_when_it_is_gone(
    open_launcher_on: Callable[..., KubernetesLauncher], kube: KubeServer, wait_for
) -> None:
    launcher = open_launcher_on()
    for slot in range(3):
        launcher.launch(rollout_spec(f"r-{slot}", command=python("print('x')")))
    for slot in range(3):
        wait_until_ended(launcher, f"r-{slot}")
    watched: Watched = launcher.pods
    assert watched.relists == 1  # every change since the first list came from the watch

    # A watch broken at this version (an API server restart, a network partition) is resumed only
    # after the cluster has moved on and etcd has compacted that version away: 410 Gone.
    broken_at = watched.resource_version
    other = open_launcher_on()
    other.launch(rollout_spec("r-meanwhile", command=python("print('meanwhile')")))
    wait_until_ended(other, "r-meanwhile")
    kube.compact()
    response = wait_for(lambda: watched._response, message="a watch is open")
    watched.resource_version = broken_at
    response.shutdown()

    wait_for(lambda: watched.relists == 2, message="the watch listed again after 410 Gone")
    assert wait_until_ended(launcher, "r-meanwhile").phase is PodPhase.SUCCEEDED
    launcher.launch(rollout_spec("r-after", command=python("print('after')")))
    assert wait_until_ended(launcher, "r-after").phase is PodPhase.SUCCEEDED
    assert watched.relists == 2  # and then watched on from the new list's version


def read_back(cluster: Cluster, kind: str, name: str) -> dict[str, Any]:
    """The object as the API server stores it (not the launcher's cache)."""
    with cluster.server.api_client() as api:
        read = {
            "Job": client.BatchV1Api(api).read_namespaced_job,
            "Pod": client.CoreV1Api(api).read_namespaced_pod,
            "Service": client.CoreV1Api(api).read_namespaced_service,
        }[kind]
        response = read(name, cluster.namespace, _preload_content=False)
        return json.loads(response.data)


def test_secret_settings_reach_pods_only_from_secrets_and_the_price_catalog_is_mounted(
    open_launcher_on: Callable[..., KubernetesLauncher],
    kube_cluster: Cluster,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    state_url = "postgresql+psycopg://spotrl:db-password-3f9a@db:5432/spotrl"
    kafka_password = "kafka-password-77c1"
    with kube_cluster.server.api_client() as api:  # the operator's Secret, as the chart's envFrom reads it
        client.CoreV1Api(api).create_namespaced_secret(
            kube_cluster.namespace,
            {
                "metadata": {"name": "backends"},
                "stringData": {"SPOTRL_STATE_URL": state_url, "SPOTRL_KAFKA_SASL_PLAIN_PASSWORD": kafka_password},
            },
        )
    # The scheduler's environment: the Secret's values, and the catalog file its own pod mounts.
    monkeypatch.setenv("SPOTRL_STATE_URL", state_url)
    monkeypatch.setenv("SPOTRL_KAFKA_SASL_PLAIN_PASSWORD", kafka_password)
    catalog = tmp_path / "catalog/catalog.json"  # the scheduler reads it too (the GPUs of an instance type)
    catalog.parent.mkdir()
    catalog.write_text((ROOT / "services/ports/prices/catalog.json").read_text())
    monkeypatch.setenv("SPOTRL_PRICE_CATALOG", str(catalog))
    get_settings.cache_clear()  # the settings of this environment, for this test only
    request.addfinalizer(get_settings.cache_clear)
    launcher = open_launcher_on(env_secrets=("backends",), price_catalog_configmap="prices")
    show = "import os; print('got', os.environ['SPOTRL_STATE_URL'], os.environ['SPOTRL_KAFKA_SASL_PLAIN_PASSWORD'])"
    launcher.launch(rollout_spec("r-secret", command=python(show)))
    launcher.launch(
        PodSpec(
            "t-secret", "run-1", "training", python(show), {"SPOTRL_STATE_URL": state_url}, "p4d.24xlarge", "on-demand"
        )
    )

    for name in ("r-secret", "t-secret"):
        wait_until_ended(launcher, name)
        assert f"got {state_url} {kafka_password}" in launcher.logs(name)  # the kubelet read them from the Secret
    (job_pod,) = [
        p["metadata"]["name"] for p in launcher.pods.snapshot() if p["metadata"]["name"].startswith("t-secret-")
    ]
    for kind, name in (("Pod", "r-secret"), ("Job", "t-secret"), ("Pod", job_pod)):
        stored = read_back(kube_cluster, kind, name)
        text = json.dumps(stored)
        assert "db-password-3f9a" not in text and kafka_password not in text, f"{kind} {name} holds a password"
        pod = stored["spec"]["template"]["spec"] if kind == "Job" else stored["spec"]
        (container,) = pod["containers"]
        assert container["envFrom"] == [{"secretRef": {"name": "backends"}}]
        assert {"name": "price-catalog", "configMap": {"name": "prices", "defaultMode": 420}} in pod["volumes"]
        assert {"name": "price-catalog", "mountPath": str(catalog.parent), "readOnly": True} in container[
            "volumeMounts"
        ]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["SPOTRL_PRICE_CATALOG"] == str(catalog)  # the same path as the scheduler's


def test_a_jobs_status_names_the_pod_the_gpu_exporter_labels(kube_cluster: Cluster, tmp_path: Path) -> None:
    """spotrl_pod_info{pod} is the Job's Kubernetes pod (``<job>-xxxxx``), as dcgm-exporter's
    DCGM_FI_DEV_GPU_UTIL{pod} has it; the PodStatus keeps the Job's name."""
    settings = Settings(
        home=tmp_path,
        launcher="kubernetes",
        kube_config=kube_cluster.server.kubeconfig,
        kube_namespace=kube_cluster.namespace,
    )
    backends = open_backends(settings)
    launcher = backends.launcher
    assert isinstance(launcher, KubernetesLauncher)
    try:
        launcher.launch(training_spec("t-gpu", command=python(SLEEPS)))
        wait_for_log(launcher, "t-gpu", "ready")
        (pod,) = [p["metadata"]["name"] for p in launcher.pods.snapshot()]
        (status,) = launcher.list()
        assert (status.name, status.platform_name) == ("t-gpu", pod) and pod.startswith("t-gpu-")

        registry = CollectorRegistry()
        registry.register(RunCollector(backends, load_catalog()))
        labels = {"run": "run-1", "role": "training", "capacity_type": "on-demand", "instance_type": "p4d.24xlarge"}
        assert registry.get_sample_value("spotrl_pod_info", {**labels, "pod": pod}) == 1
        launcher.delete("t-gpu")
    finally:
        backends.close()
    # Closing the backends closed the launcher: its watches have ended.
    assert not launcher.pods._thread.is_alive() and not launcher.jobs._thread.is_alive()


def test_settings_select_the_kubernetes_launcher(
    kube: KubeServer, kube_namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the chart passes them: names comma-separated, maps and lists as JSON.
    for key, value in {
        "LAUNCHER": "kubernetes",
        "KUBE_CONFIG": str(kube.kubeconfig),
        "KUBE_NAMESPACE": kube_namespace,
        "KUBE_SPOT_LABELS": "example.com/spot=yes",
        "KUBE_ROLLOUT_IMAGE": "r.example/spotrl-rollout:2",
        "KUBE_TRAINING_IMAGE": "r.example/spotrl-training:2",
        "KUBE_IMAGE_PULL_POLICY": "Always",
        "KUBE_IMAGE_PULL_SECRETS": "pull-a, pull-b",
        "KUBE_SERVICE_ACCOUNT": "spotrl-workload",
        "KUBE_ENV_SECRETS": "backends,s3-keys",
        "KUBE_PRICE_CATALOG_CONFIGMAP": "spotrl-price-catalog",
        "KUBE_POD_LABELS": '{"app.kubernetes.io/instance": "spotrl"}',
        "KUBE_ROLLOUT_NODE_SELECTOR": '{"example.com/pool": "gpu-spot"}',
        "KUBE_TRAINING_TOLERATIONS": '[{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]',
        "KUBE_REQUEST_FRACTION": "0.6",
        "KUBE_SHM_FRACTION": "0.1",
        "KUBE_SPOT_NOTICE_S": "30",
        "KUBE_RUN_AS_USER": "2000",
        "KUBE_READ_ONLY_ROOT": "false",
    }.items():
        monkeypatch.setenv(f"SPOTRL_{key}", value)
    settings = Settings(home=tmp_path)
    launcher = open_launcher(settings, tmp_path)
    try:
        assert isinstance(launcher, KubernetesLauncher)
        cfg = launcher.cfg
        assert cfg.namespace == kube_namespace and cfg.spot_labels == {"example.com/spot": "yes"}
        assert cfg.images == {"rollout": "r.example/spotrl-rollout:2", "training": "r.example/spotrl-training:2"}
        assert (cfg.image_pull_policy, cfg.image_pull_secrets, cfg.service_account) == (
            "Always",
            ("pull-a", "pull-b"),
            "spotrl-workload",
        )
        assert (cfg.env_secrets, cfg.price_catalog_configmap) == (("backends", "s3-keys"), "spotrl-price-catalog")
        assert cfg.pod_labels == {"app.kubernetes.io/instance": "spotrl"}
        assert (cfg.request_fraction, cfg.shm_fraction, cfg.run_as_user, cfg.read_only_root) == (0.6, 0.1, 2000, False)
        assert cfg.spot_notice_s == 30  # GCP's notice: the grace of spot pods
        defaults = KubernetesConfig()
        assert cfg.node_selectors == {**defaults.node_selectors, "rollout": {"example.com/pool": "gpu-spot"}}
        assert cfg.tolerations == {
            **defaults.tolerations,
            "training": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        }
        assert launcher.list() == []
    finally:
        launcher.close()


async def test_the_api_lists_and_counts_a_pod_that_waits_for_a_node(kube_cluster: Cluster, settings: Settings) -> None:
    kube_cluster.kubelet.spot_capacity.clear()
    async with app_client(
        settings,
        launcher="kubernetes",
        kube_config=kube_cluster.server.kubeconfig,
        kube_namespace=kube_cluster.namespace,
    ) as client:
        run = await client.post(
            "/v1/runs",
            json={"model": "tiny", "prompts": [{"prompt": "1+1=", "answer": "2"}], "batch_samples": 8, "iterations": 1},
        )
        assert run.status_code == 201, run.text
        run_id = run.json()["id"]
        pod = rollout_pod_name(run_id, 0)
        client.app.state.backends.launcher.launch(  # type: ignore[attr-defined]
            PodSpec(pod, run_id, "rollout", python(SLEEPS), {}, "g6.xlarge", "spot", {"slot": "0"})
        )
        listed = (await client.get(f"/v1/runs/{run_id}/pods")).json()["pods"]
        metrics = (await client.get("/metrics")).text
    assert listed == [{"name": pod, "role": "rollout", "running": True, "waiting_for_node": True}]
    labels = f'{{capacity_type="spot",instance_type="g6.xlarge",role="rollout",run="{run_id}"}}'
    assert f"spotrl_pods_waiting_for_node{labels} 1.0" in metrics and f"spotrl_pods{labels} 0.0" in metrics
    assert "spotrl_pod_info{" not in metrics  # no GPU of a node to join to
