"""The Helm chart deploy/helm/spotrl, checked with Helm's own Go code (helm-python-sdk: render,
lint, the values schema) and every rendered manifest validated strictly against the OpenAPI
schemas of current Kubernetes releases (kubernetes-validate), for each scenario in ci/."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from services.core.config import Settings
from services.ports.launcher.kubernetes_objects import Machine, inherited_env, job_manifest, pod_manifest
from services.ports.launcher.launcher import PodSpec
from services.ports.prices.catalog import parse_catalog
from services.ports.wiring import kubernetes_config
from tests.pod_security import restricted_violations

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/spotrl"
SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*.yaml"))
# The oldest Kubernetes release with patch support from every large provider, and the newest schema kubernetes-validate has.
KUBE_VERSIONS = ["1.30.0", "1.37.0"]
RELEASE, NAMESPACE = "spotrl", "ml"
# The Prometheus Operator's kind is a CRD: kubernetes-validate carries the built-in kinds only, so
# its shape is asserted in test_service_monitor instead.
CUSTOM_KINDS = {"ServiceMonitor"}
G5, P4D = Machine(gpus=1, vcpus=4, memory_gib=16), Machine(gpus=8, vcpus=96, memory_gib=1152)


def scenario(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "ci" / name).read_text())


def render(
    values: dict[str, Any], chart_dir: Path = CHART, release: str = RELEASE, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(chart_dir).render(values, name=release, namespace=namespace, is_install=True)
    return [
        doc
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


@pytest.fixture(scope="module", params=SCENARIOS)
def rendered(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(scenario(request.param))


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_lints_strictly(name: str) -> None:
    report = helm.lint(CHART, scenario(name), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSIONS[0]}")
    # Severity 1 is information ("icon is recommended"); warnings (2) fail under strict, as errors (3) do.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


def test_every_manifest_validates_strictly(rendered) -> None:
    name, docs = rendered
    checked = 0
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on an unknown field or a wrong type
        checked += 1
    assert checked >= 15, f"{name} rendered only {checked} built-in objects"


def test_pods_run_non_root_with_limits(rendered) -> None:
    _, docs = rendered
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "Job")}
    assert "spotrl-teardown" in workloads  # the uninstall hook's Job
    for name, deployment in workloads.items():
        # Pod Security Standards, "restricted", field by field: the namespace may enforce it.
        assert restricted_violations(deployment["spec"]["template"]) == [], name
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] > 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["enableServiceLinks"] is False, name
        # Pod Security Standards, "restricted": no host namespaces, only the volume types it allows.
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod), name
        for volume in pod.get("volumes", []):
            assert set(volume) - {"name"} <= {
                "configMap",
                "secret",
                "emptyDir",
                "persistentVolumeClaim",
                "projected",
                "downwardAPI",
            }, (name, volume)
        for c in containers(deployment):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, name
            assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"], name
            if c["image"].split("/")[-1].startswith("spotrl-"):
                assert sc["readOnlyRootFilesystem"] is True, name
        # Only the two control-plane components and the uninstall hook talk to the Kubernetes API.
        if not name.endswith(("-api", "-scheduler", "-teardown")):
            assert pod.get("automountServiceAccountToken") is False, name


def test_no_secret_outside_secrets(rendered) -> None:
    """Passwords, keys and token hashes of the scenario appear in Secrets and nowhere else."""
    name, docs = rendered
    values = scenario(name)
    secrets = [
        values.get("trial", {}).get("postgresql", {}).get("password"),
        values.get("s3", {}).get("accessKey", {}).get("secret"),
        values.get("s3", {}).get("accessKey", {}).get("id"),
    ]
    secrets += [t["sha256"] for t in values.get("auth", {}).get("tokens", {}).values()]
    if state_url := values.get("backends", {}).get("stateUrl"):
        secrets.append(re.search(r"://[^:]+:([^@]+)@", state_url).group(1))
    secrets = [s for s in secrets if s]
    for doc in docs:
        text = json.dumps(doc)
        if doc["kind"] == "Secret":
            continue
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{doc['kind']} {doc['metadata']['name']} holds {leaked}"
        for c in containers(doc) if doc["kind"] == "Deployment" else []:
            for env in c.get("env", []):
                assert not re.search("PASSWORD|SECRET|TOKEN", env["name"]) or "valueFrom" in env, (
                    doc["metadata"]["name"],
                    env,
                )
    if values.get("auth", {}).get("tokens"):
        (tokens,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-tokens")]
        assert {e["sha256"] for e in json.loads(tokens["stringData"]["tokens.json"])["tokens"]} == {
            t["sha256"] for t in values["auth"]["tokens"].values()
        }


def test_rbac_scope(rendered) -> None:
    _, docs = rendered
    roles, cluster_roles = by_kind(docs, "Role"), by_kind(docs, "ClusterRole")
    scheduler = {
        (g, r): set(rule["verbs"])
        for rule in roles["spotrl-scheduler"]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    manage = {"get", "list", "watch", "create", "update", "patch", "delete"}
    assert scheduler == {
        ("batch", "jobs"): manage,
        ("", "pods"): manage,
        ("", "pods/log"): {"get"},
        ("", "pods/status"): {"get"},
        ("", "services"): {"get", "create", "delete"},  # a multi-node training Job's headless Service
    }
    # The API opens the same launcher, read-only: it watches pods and Jobs and reads pod logs.
    api = {
        (g, r): set(rule["verbs"])
        for rule in roles["spotrl-api"]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert api == {
        ("", "pods"): {"get", "list", "watch"},
        ("", "pods/log"): {"get"},
        ("batch", "jobs"): {"get", "list", "watch"},
    }
    # The one cluster-wide grant: reading nodes (their instance-type and capacity labels).
    (nodes,) = cluster_roles.values()
    assert nodes["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    bindings = list(by_kind(docs, "RoleBinding").values()) + list(by_kind(docs, "ClusterRoleBinding").values())
    subjects = {(b["roleRef"]["kind"], b["roleRef"]["name"]): [s["name"] for s in b["subjects"]] for b in bindings}
    # The uninstall hook reads, stops and deletes the launched pods and Jobs (and a multi-node Job's
    # Service): it creates none.
    teardown = {
        (g, r): set(rule["verbs"])
        for rule in roles["spotrl-teardown"]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert teardown == {
        ("", "pods"): {"get", "list", "watch", "patch", "delete"},
        ("batch", "jobs"): {"get", "list", "watch", "patch", "delete"},
        ("", "services"): {"delete"},
    }
    assert subjects == {
        ("Role", "spotrl-scheduler"): ["spotrl-scheduler"],
        ("Role", "spotrl-api"): ["spotrl-api"],
        ("Role", "spotrl-teardown"): ["spotrl-teardown"],
        ("ClusterRole", nodes["metadata"]["name"]): ["spotrl-scheduler", "spotrl-api"],
    }
    for rule in [r for role in [*roles.values(), nodes] for r in role["rules"]]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"] and "secrets" not in rule["resources"]
    deployments = by_kind(docs, "Deployment")
    assert deployments["spotrl-scheduler"]["spec"]["template"]["spec"]["serviceAccountName"] == "spotrl-scheduler"
    assert deployments["spotrl-api"]["spec"]["template"]["spec"]["serviceAccountName"] == "spotrl-api"


def test_selectors_match_their_pods(rendered) -> None:
    """Selectors carry name, instance and component only; every Service, PDB and NetworkPolicy selects a Deployment's pods."""
    _, docs = rendered
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in by_kind(docs, "Deployment").items()}
    for d in by_kind(docs, "Deployment").values():
        assert set(d["spec"]["selector"]["matchLabels"]) == {
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/component",
        }
    selectors = [(d["kind"], d["metadata"]["name"], d["spec"]["selector"]) for d in docs if d["kind"] == "Service"]
    selectors += [
        (d["kind"], d["metadata"]["name"], d["spec"]["selector"]["matchLabels"])
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    ]
    selectors += [
        (d["kind"], d["metadata"]["name"], d["spec"]["podSelector"]["matchLabels"])
        for d in docs
        if d["kind"] == "NetworkPolicy"
    ]
    for kind, name, selector in selectors:
        matched = [p for p, labels in pods.items() if selector.items() <= labels.items()]
        assert matched == [name], (kind, name, matched)
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        assert pdb["apiVersion"] == "policy/v1" and "maxUnavailable" in pdb["spec"]


CAPACITY_LABELS = {
    "karpenter": {
        "rollout": {"karpenter.sh/capacity-type": "spot"},
        "training": {"karpenter.sh/capacity-type": "on-demand"},
    },
    "eks": {
        "rollout": {"eks.amazonaws.com/capacityType": "SPOT"},
        "training": {"eks.amazonaws.com/capacityType": "ON_DEMAND"},
    },
    "gke": {"rollout": {"cloud.google.com/gke-spot": "true"}},
    "none": {},
}


def settings_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return by_kind(docs, "ConfigMap")["spotrl-settings"]["data"]


def test_processes_and_their_settings(rendered, monkeypatch) -> None:
    """The containers run the real `spotrl` commands, and every setting the chart passes is one spotrl reads."""
    name, docs = rendered
    values = scenario(name)
    deployments = by_kind(docs, "Deployment")
    (api,), (scheduler,) = containers(deployments["spotrl-api"]), containers(deployments["spotrl-scheduler"])
    assert api["args"][:1] == ["serve"] and "--no-scheduler" in api["args"] and "--insecure-no-auth" not in api["args"]
    # The scheduler serves its health for its probes (services/control/scheduler/health.py), on the port they ask.
    assert scheduler["args"] == ["scheduler", "--health-port", "8001"]
    assert scheduler["ports"] == [{"name": "health", "containerPort": 8001, "protocol": "TCP"}]
    assert (scheduler["livenessProbe"]["httpGet"], scheduler["readinessProbe"]["httpGet"]) == (
        {"path": "/healthz", "port": "health"},
        {"path": "/readyz", "port": "health"},
    )
    assert deployments["spotrl-scheduler"]["spec"]["replicas"] == values.get("scheduler", {}).get("replicas", 2)
    env = settings_env(docs)
    # Every name is a setting spotrl reads.
    fields = {f"SPOTRL_{f.upper()}" for f in Settings.model_fields}
    assert {k for k in env if k.startswith("SPOTRL_")} <= fields, {k for k in env if k.startswith("SPOTRL_")} - fields
    for key, value in env.items():
        if key in fields:
            monkeypatch.setenv(key, value)
    parsed = Settings()  # the values parse as the settings' types
    assert parsed.launcher == "kubernetes" and parsed.kube_image == env["SPOTRL_KUBE_IMAGE"]
    assert str(parsed.price_catalog) == env["SPOTRL_PRICE_CATALOG"] and parsed.stop_grace_s == float(
        env["SPOTRL_STOP_GRACE_S"]
    )
    pools = helm.Chart.load(CHART).merge_values(values)["pools"]
    capacity = CAPACITY_LABELS[pools["capacityLabel"]]
    for pool in ("rollout", "training"):  # the reward pool is the chart's reward service's
        selector = json.loads(env[f"SPOTRL_KUBE_{pool.upper()}_NODE_SELECTOR"])
        assert selector == capacity.get(pool, {}) | pools[pool]["nodeSelector"]
        assert json.loads(env[f"SPOTRL_KUBE_{pool.upper()}_TOLERATIONS"]) == pools[pool]["tolerations"]
    assert parsed.kube_spot_notice_s == pools["spotNoticeS"]
    assert env["SPOTRL_KUBE_SERVICE_ACCOUNT"] in by_kind(docs, "ServiceAccount")
    assert env["SPOTRL_KUBE_ROLLOUT_IMAGE"].rsplit("/", 1)[-1].startswith("spotrl-rollout:")
    assert env["SPOTRL_KUBE_TRAINING_IMAGE"].rsplit("/", 1)[-1].startswith("spotrl-training:")
    assert env["SPOTRL_OBJECTS_URL"] == values["s3"]["url"]
    # The files the settings name are where the pods mount them.
    mounts = {m["name"]: m["mountPath"] for m in api["volumeMounts"]}
    assert env["SPOTRL_PRICE_CATALOG"] == f"{mounts['price-catalog']}/catalog.json"
    catalog = next(
        v for v in deployments["spotrl-api"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "price-catalog"
    )
    assert catalog["configMap"]["name"] == env["SPOTRL_KUBE_PRICE_CATALOG_CONFIGMAP"]
    assert env["SPOTRL_TOKENS_FILE"] == f"{mounts['tokens']}/tokens.json"
    assert {m["name"] for m in scheduler["volumeMounts"]} == {"tmp", "price-catalog"}  # no tokens: it serves nothing
    # The backends' URLs come from a Secret, to the chart's pods and (SPOTRL_KUBE_ENV_SECRETS) to launched ones.
    secret_refs = [e["secretRef"]["name"] for e in api["envFrom"] if "secretRef" in e]
    assert secret_refs == env["SPOTRL_KUBE_ENV_SECRETS"].split(",")
    backends = values.get("backends", {}).get("existingSecret")
    if not backends:
        urls = by_kind(docs, "Secret")[secret_refs[0]]["stringData"]
        assert urls["SPOTRL_STATE_URL"].startswith("postgresql+psycopg://")
        assert urls["SPOTRL_QUEUE_URL"].startswith("kafka://") and urls["SPOTRL_REWARD_CACHE_URL"].startswith(
            "redis://"
        )
    else:
        assert secret_refs[0] == backends


def test_the_launcher_runs_pods_as_the_chart_means(rendered, monkeypatch) -> None:
    """The scheduler's launcher, configured by the chart's settings (and its Secret's URLs in its
    environment, as envFrom puts them), launches pods with the chart's images, identity, pools and
    labels, the price catalog mounted where SPOTRL_PRICE_CATALOG names it, and no secret value."""
    name, docs = rendered
    values = helm.Chart.load(CHART).merge_values(scenario(name))
    env = settings_env(docs)
    secret_values = {
        k: v for secret in by_kind(docs, "Secret").values() for k, v in secret.get("stringData", {}).items()
    }
    if values["backends"]["existingSecret"]:  # the operator's Secret: what it would hold
        secret_values = {
            "SPOTRL_STATE_URL": "postgresql+psycopg://spotrl:operators-db-password@db/spotrl",
            "SPOTRL_KAFKA_SASL_PLAIN_PASSWORD": "operators-kafka-password",
        }
    for key, value in {**env, **secret_values}.items():
        monkeypatch.setenv(key, value)
    cfg = kubernetes_config(Settings())
    inherited = inherited_env()
    assert secret_values.keys() & inherited.keys()  # the scheduler has the secrets; its pods must not show them
    # A run asks for its pool's instance type, where the pool has one.
    pinned = {
        role: values["pools"][role]["nodeSelector"].get("node.kubernetes.io/instance-type")
        for role in ("rollout", "training")
    }
    rollout = PodSpec(
        "run-1-rollout-0", "run-1", "rollout", ["spotrl", "worker"], {}, pinned["rollout"] or "g5.xlarge", "on-demand"
    )
    training = PodSpec(
        "run-1-train-0",
        "run-1",
        "training",
        ["spotrl", "train-job"],
        {},
        pinned["training"] or "p4d.24xlarge",
        "on-demand",
    )
    manifests = {
        "rollout": pod_manifest(rollout, cfg, G5, inherited),
        "training": job_manifest(training, cfg, P4D, inherited)["spec"]["template"],
    }
    for role, manifest in manifests.items():
        pod, labels = manifest["spec"], manifest["metadata"]["labels"]
        (container,) = pod["containers"]
        assert container["image"] == env[f"SPOTRL_KUBE_{role.upper()}_IMAGE"], role
        assert container["imagePullPolicy"] == values["image"]["pullPolicy"]
        assert [s["name"] for s in pod.get("imagePullSecrets", [])] == values["image"]["pullSecrets"]
        assert (
            pod["serviceAccountName"] == env["SPOTRL_KUBE_SERVICE_ACCOUNT"]
            and pod["automountServiceAccountToken"] is False
        )
        # They run as the chart's own pods do, and as Pod Security's restricted profile admits.
        assert pod["securityContext"]["runAsUser"] == values["podSecurityContext"]["runAsUser"]
        assert restricted_violations(manifest) == [], role
        # The secrets come from the chart's Secrets, by reference.
        assert [e["secretRef"]["name"] for e in container["envFrom"]] == env["SPOTRL_KUBE_ENV_SECRETS"].split(",")
        leaked = [k for k, v in secret_values.items() if v in json.dumps(manifest)]
        assert not leaked, (role, leaked)
        # The price catalog file its settings name is there.
        mount = next(m for m in container["volumeMounts"] if m["name"] == "price-catalog")
        volume = next(v for v in pod["volumes"] if v["name"] == "price-catalog")
        assert f"{mount['mountPath']}/catalog.json" == env["SPOTRL_PRICE_CATALOG"] == inherited["SPOTRL_PRICE_CATALOG"]
        assert volume["configMap"]["name"] == env["SPOTRL_KUBE_PRICE_CATALOG_CONFIGMAP"]
        # The pool: its labels (the capacity label is the pod's own affinity) and tolerations.
        assert values["pools"][role]["nodeSelector"].items() <= pod["nodeSelector"].items()
        assert pod["tolerations"] == values["pools"][role]["tolerations"]
        # The reward service and trial backends admit the release's pods: these carry its labels.
        for policy_name, policy in by_kind(docs, "NetworkPolicy").items():
            if policy_name.rsplit("-", 1)[-1] in {"reward", "kafka", "redis", "postgresql"}:
                ((source,),) = [rule["from"] for rule in policy["spec"]["ingress"]]
                assert source["podSelector"]["matchLabels"].items() <= labels.items(), (role, policy_name)
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role}, "spec": pod}, version, strict=True
            )


# Each provider's GPU nodes of the training pool, spot and on-demand: their capacity label and
# their taints besides the pool's (GKE taints GPU nodes nvidia.com/gpu=present, and its spot
# node pools cloud.google.com/gke-spot=true).
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GKE_SPOT_TAINT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}
PROVIDER_NODES = {
    "karpenter": {
        "spot": ({"karpenter.sh/capacity-type": "spot"}, []),
        "on-demand": ({"karpenter.sh/capacity-type": "on-demand"}, []),
    },
    "eks": {
        "spot": ({"eks.amazonaws.com/capacityType": "SPOT"}, []),
        "on-demand": ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, []),
    },
    "gke": {
        "spot": ({"cloud.google.com/gke-spot": "true"}, [GPU_TAINT, GKE_SPOT_TAINT]),
        "on-demand": ({}, [GPU_TAINT]),
    },
}


def schedules_onto(pod: dict[str, Any], labels: dict[str, str], taints: list[dict[str, str]]) -> bool:
    """The scheduler's filters for a pod and a node: nodeSelector, required node affinity (terms
    ORed, In/NotIn expressions ANDed), and a toleration of every NoSchedule taint."""
    if any(labels.get(k) != v for k, v in pod["nodeSelector"].items()):
        return False
    ops = {"In": lambda k, v: labels.get(k) in v, "NotIn": lambda k, v: labels.get(k) not in v}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    if not any(all(ops[e["operator"]](e["key"], e["values"]) for e in t["matchExpressions"]) for t in terms):
        return False
    return all(
        any(
            t["key"] == taint["key"]
            and t.get("effect") in (None, taint["effect"])
            and (t["operator"] == "Exists" or t.get("value") == taint["value"])
            for t in pod["tolerations"]
        )
        for taint in taints
    )


@pytest.mark.parametrize("provider", PROVIDER_NODES)
def test_training_jobs_land_on_the_training_pools_nodes_of_their_capacity(provider: str, monkeypatch) -> None:
    """With the chart's settings for each provider's capacity label, an on-demand training Job takes
    only the training pool's on-demand nodes and a spot one only its spot nodes; the spot one has the
    spot notice to checkpoint in and ends with its pod's disruption (FailJob), where an on-demand
    one makes a new pod (Ignore)."""
    values = scenario("minimal-trial-values.yaml") | {"pools": {"capacityLabel": provider}}
    env = settings_env(render(values))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = kubernetes_config(Settings())
    pool = {"spotrl.dev/pool": "training", "node.kubernetes.io/instance-type": "p4d.24xlarge"}
    pool_taint = {"key": "spotrl.dev/pool", "value": "training", "effect": "NoSchedule"}
    nodes = {
        capacity: ({**pool, **labels}, [pool_taint, *taints])
        for capacity, (labels, taints) in PROVIDER_NODES[provider].items()
    }
    for capacity in ("spot", "on-demand"):
        spec = PodSpec("run-1-train-0", "run-1", "training", ["spotrl", "train-job"], {}, "p4d.24xlarge", capacity)
        job = job_manifest(spec, cfg, P4D, inherited_env())
        pod = job["spec"]["template"]["spec"]
        assert [c for c, node in nodes.items() if schedules_onto(pod, *node)] == [capacity], (provider, capacity)
        (rule,) = job["spec"]["podFailurePolicy"]["rules"]
        assert rule == {
            "action": "FailJob" if capacity == "spot" else "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        }
        assert pod["terminationGracePeriodSeconds"] == (120 if capacity == "spot" else 60)
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(job, version, strict=True)


def test_minimal_trial_wires_the_in_chart_backends() -> None:
    docs = render(scenario("minimal-trial-values.yaml"))
    urls = by_kind(docs, "Secret")["spotrl-backends"]["stringData"]
    services = {name: d["spec"]["ports"][0]["port"] for name, d in by_kind(docs, "Service").items()}
    assert urls["SPOTRL_QUEUE_URL"] == f"kafka://spotrl-kafka:{services['spotrl-kafka']}"
    assert urls["SPOTRL_REWARD_CACHE_URL"] == f"redis://spotrl-redis:{services['spotrl-redis']}/0"
    assert (
        urls["SPOTRL_STATE_URL"]
        == f"postgresql+psycopg://spotrl:trial-postgres-password@spotrl-postgresql:{services['spotrl-postgresql']}/spotrl"
    )
    assert urls["AWS_SECRET_ACCESS_KEY"] == "trial-secret-access-key-example"
    (pg,) = containers(by_kind(docs, "Deployment")["spotrl-postgresql"])
    password = next(e for e in pg["env"] if e["name"] == "POSTGRES_PASSWORD")
    assert password["valueFrom"]["secretKeyRef"]["name"] in by_kind(docs, "Secret")
    # The trial servers take connections from this release's pods only.
    policy = by_kind(docs, "NetworkPolicy")["spotrl-postgresql"]["spec"]["ingress"]
    assert policy == [
        {
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE}}}],
            "ports": [{"port": 5432, "protocol": "TCP"}],
        }
    ]
    assert json.loads(settings_env(docs)["SPOTRL_KUBE_POD_LABELS"])["app.kubernetes.io/instance"] == RELEASE
    assert by_kind(docs, "NetworkPolicy")["spotrl-scheduler"]["spec"].get("ingress") is None  # no ingress at all


def test_price_catalog_ships_spotrl_catalog_with_user_prices() -> None:
    assert (CHART / "files/catalog.json").read_text() == (ROOT / "services/ports/prices/catalog.json").read_text(), (
        "copy services/ports/prices/catalog.json to the chart's files/ when prices change"
    )
    shipped = json.loads((ROOT / "services/ports/prices/catalog.json").read_text())
    values = scenario("production-values.yaml")
    docs = render(values)
    catalog = parse_catalog(json.loads(by_kind(docs, "ConfigMap")["spotrl-price-catalog"]["data"]["catalog.json"]))
    assert catalog.get("g5.xlarge").spot == 0.38  # the operator's price wins
    assert catalog.get("g6e.2xlarge").on_demand == pytest.approx(2.24208)  # an added type
    assert catalog.get("p4d.24xlarge").on_demand == shipped["instances"]["p4d.24xlarge"]["on_demand"]  # the rest stay
    assert set(catalog.instances) == set(shipped["instances"]) | set(values["priceCatalog"]["instances"])
    # Changed prices roll the pods (a checksum of the catalog in their template).
    cheaper = json.loads(json.dumps(values))
    cheaper["priceCatalog"]["instances"]["g5.xlarge"]["spot"] = 0.30

    def checksum(docs: list[dict[str, Any]]) -> str:
        return by_kind(docs, "Deployment")["spotrl-scheduler"]["spec"]["template"]["metadata"]["annotations"][
            "checksum/price-catalog"
        ]

    assert checksum(render(cheaper)) != checksum(docs)


def hooks(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (d["kind"], d["metadata"]["name"]): d for d in docs if "helm.sh/hook" in d["metadata"].get("annotations", {})
    }


def test_uninstall_first_runs_the_teardown_under_its_own_identity() -> None:
    """A pre-delete hook Job runs `spotrl teardown` (services/control/scheduler/teardown.py) with the
    scheduler's settings and Secrets, under a ServiceAccount and Role of its own created just before
    it (hooks are not release objects); teardown.enabled false renders none."""
    from typer.main import get_command

    from services.cli.main import app

    values = scenario("minimal-trial-values.yaml")
    docs = render(_merge(values, {"teardown": {"graceSeconds": 20, "timeoutSeconds": 100}}))
    found = hooks(docs)
    assert set(found) == {(kind, "spotrl-teardown") for kind in ("ServiceAccount", "Role", "RoleBinding", "Job")}
    for (kind, _), doc in found.items():
        annotations = doc["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        # A failed Job stays for its logs; the next attempt replaces it.
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        # Helm creates a phase's hooks by weight, and waits for a Job to end: its identity first.
        assert (int(annotations["helm.sh/hook-weight"]) < 0) is (kind != "Job"), kind
    job = found[("Job", "spotrl-teardown")]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["teardown", "--grace-s", "20", "--timeout-s", "100"]
    get_command(app).commands["teardown"].make_context("teardown", container["args"][1:])  # options the command has
    assert job["spec"]["activeDeadlineSeconds"] > 100 and pod["restartPolicy"] == "Never"
    binding = found[("RoleBinding", "spotrl-teardown")]
    assert binding["roleRef"]["name"] == pod["serviceAccountName"] == "spotrl-teardown"
    assert [s["name"] for s in binding["subjects"]] == ["spotrl-teardown"]
    # The scheduler's image, settings and Secrets: the launcher in this namespace, the state store.
    (scheduler,) = containers(by_kind(docs, "Deployment")["spotrl-scheduler"])
    assert (container["image"], container["envFrom"], container["env"]) == (
        scheduler["image"],
        scheduler["envFrom"],
        scheduler["env"],
    )
    # The trial PostgreSQL admits it (the release's pods only).
    (rule,) = by_kind(docs, "NetworkPolicy")["spotrl-postgresql"]["spec"]["ingress"]
    assert (
        rule["from"][0]["podSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    )
    assert hooks(render(_merge(values, {"teardown": {"enabled": False}}))) == {}
    # The chart asks for the Kubernetes whose Job controller applies the training Jobs' podFailurePolicy by default.
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == ">=1.26.0-0"
    assert (
        "podFailurePolicy"
        in job_manifest(
            PodSpec("t", "r", "training", ["spotrl"], {}, "p4d.24xlarge", "on-demand"),
            kubernetes_config(Settings()),
            P4D,
            {},
        )["spec"]
    )


def test_production_ingress_service_monitor_and_identity() -> None:
    values = scenario("production-values.yaml")
    docs = render(values)
    (ingress,) = by_kind(docs, "Ingress").values()
    assert ingress["spec"]["tls"] == [{"hosts": ["spotrl.acme.example"], "secretName": "spotrl-acme-tls"}]
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"] == {
        "name": "spotrl-api",
        "port": {"name": "http"},
    }
    for name, account in by_kind(docs, "ServiceAccount").items():
        if name != "spotrl-teardown":  # the uninstall hook's reaches no S3
            assert account["metadata"]["annotations"] == values["serviceAccount"]["annotations"]
    # The chart makes no Secret of its own: backends and tokens are the operator's.
    assert by_kind(docs, "Secret") == {}
    (reward,) = containers(by_kind(docs, "Deployment")["spotrl-reward"])
    assert reward["args"] == [
        "reward-server",
        "--host",
        "0.0.0.0",
        "--port",
        "8100",
        "--model",
        "/models/helpfulness-rm-v3",
    ]
    assert settings_env(docs)["SPOTRL_REWARD_SERVICE_URLS"] == "http://spotrl-reward.ml.svc:8100"
    assert reward["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "command" not in reward and reward["image"].rsplit("/", 1)[-1].startswith("spotrl-rollout:")
    (model,) = [
        v
        for v in by_kind(docs, "Deployment")["spotrl-reward"]["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "model"
    ]
    assert model["persistentVolumeClaim"] == {"claimName": "reward-models", "readOnly": True}
    # On the reward pool; its Service is the URL runs name (SPOTRL_REWARD_SERVICE_URLS).
    pool, pod = (
        helm.Chart.load(CHART).merge_values(values)["pools"]["reward"],
        by_kind(docs, "Deployment")["spotrl-reward"]["spec"]["template"]["spec"],
    )
    assert (pod["nodeSelector"], pod["tolerations"]) == (pool["nodeSelector"], pool["tolerations"])
    service = by_kind(docs, "Service")["spotrl-reward"]
    assert (
        f"http://{service['metadata']['name']}.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}"
        == settings_env(docs)["SPOTRL_REWARD_SERVICE_URLS"]
    )


REWARD_IMAGE = "registry.acme.example/ml/rewards:2025.06@sha256:" + "ab" * 32


def reward_function_values(**function: Any) -> dict[str, Any]:
    """The trial scenario with the reward service serving the user's function from the user's image."""
    values = scenario("minimal-trial-values.yaml")
    values["reward"] = {
        "enabled": True,
        "image": {
            "registry": "registry.acme.example/ml",
            "repository": "rewards",
            "tag": "2025.06",
            "digest": "sha256:" + "ab" * 32,
        },
        "function": {
            "reference": "/app/rewards.py:compute_score",
            "workers": 4,
            "timeoutSeconds": 2.5,
            "memoryMb": 2048,
        }
        | function,
    }
    return values


def reward_pod(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = by_kind(docs, "Deployment")["spotrl-reward"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def reward_server_options(args: list[str]) -> dict[str, Any]:
    """What `spotrl reward-server` makes of ``args``: parsed by the CLI itself, nothing started."""
    import typer

    from services.cli.main import app

    assert args[0] == "reward-server"
    return typer.main.get_command(app).commands["reward-server"].make_context("reward-server", args[1:]).params


def test_reward_function_runs_from_the_users_image() -> None:
    """A reward function: the user's image with `spotrl reward-server --function`, the pool's
    limits as arguments the CLI accepts, CPU and memory sized to the workers, no GPU, no claim,
    and the chart's security context, probes and read-only root."""
    values = reward_function_values()
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSIONS[0]}")
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report
    docs = render(values)
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
    pod, reward = reward_pod(docs)
    assert reward["image"] == REWARD_IMAGE and reward["command"] == ["spotrl"]
    assert reward["args"] == [
        "reward-server",
        "--host",
        "0.0.0.0",
        "--port",
        "8100",
        "--function",
        "/app/rewards.py:compute_score",
        "--workers",
        "4",
        "--timeout-s",
        "2.5",
        "--memory-mb",
        "2048",
    ]
    options = reward_server_options(reward["args"])
    assert (options["function"], options["model"], options["batched"]) == ("/app/rewards.py:compute_score", None, False)
    assert (options["workers"], options["timeout_s"], options["memory_mb"], options["port"]) == (4, 2.5, 2048, 8100)
    # No GPU: one CPU per worker, every worker at its address-space limit plus 512 MiB for the server.
    assert reward["resources"] == {
        "requests": {"cpu": "4", "memory": f"{4 * 2048 + 512}Mi"},
        "limits": {"memory": f"{4 * 2048 + 512}Mi"},
    }
    assert "gpu" not in json.dumps(reward["resources"])
    # No model: only the /tmp scratch space.
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    assert reward["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert "persistentVolumeClaim" not in json.dumps(docs)
    merged = helm.Chart.load(CHART).merge_values(values)
    assert (
        reward["securityContext"] == merged["containerSecurityContext"]
        and reward["securityContext"]["readOnlyRootFilesystem"] is True
    )
    assert pod["securityContext"] == merged["podSecurityContext"] and pod["automountServiceAccountToken"] is False
    assert (
        reward["readinessProbe"]["httpGet"] == reward["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    )
    # On the reward pool, behind the Service runs name, admitted from the release's pods only.
    assert (pod["nodeSelector"], pod["tolerations"]) == (
        merged["pools"]["reward"]["nodeSelector"],
        merged["pools"]["reward"]["tolerations"],
    )
    assert settings_env(docs)["SPOTRL_REWARD_SERVICE_URLS"] == "http://spotrl-reward.ml.svc:8100"
    assert by_kind(docs, "NetworkPolicy")["spotrl-reward"]["spec"]["ingress"][0]["ports"] == [
        {"port": 8100, "protocol": "TCP"}
    ]


def test_reward_function_options() -> None:
    # batched: true forces lists; null and false leave it to the parameter names.
    for batched, flag in ((True, True), (None, False), (False, False)):
        _, reward = reward_pod(render(reward_function_values(batched=batched)))
        assert ("--batched" in reward["args"]) is flag and reward_server_options(reward["args"])["batched"] is flag
    # Without an image of the user's: the chart's rollout image and its own entrypoint.
    values = reward_function_values(reference="rewards.math:compute_score")
    del values["reward"]["image"]
    _, reward = reward_pod(render(values))
    assert reward["image"].rsplit("/", 1)[-1].startswith("spotrl-rollout:") and "command" not in reward
    # A repository that names its registry, pinned by tag alone.
    values["reward"]["image"] = {"repository": "123456789012.dkr.ecr.us-east-1.amazonaws.com/rewards", "tag": "v3"}
    assert reward_pod(render(values))[1]["image"] == "123456789012.dkr.ecr.us-east-1.amazonaws.com/rewards:v3"
    # The user's own resources (a GPU for a function that wants one), nodes and tolerations.
    values = reward_function_values(
        resources={"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "3Gi", "nvidia.com/gpu": 1}}
    )
    values["reward"] |= {
        "nodeSelector": {"spotrl.dev/pool": "cpu"},
        "tolerations": [{"key": "spotrl.dev/pool", "operator": "Exists"}],
    }
    pod, reward = reward_pod(render(values))
    assert reward["resources"] == values["reward"]["function"]["resources"]
    assert pod["nodeSelector"] == {"spotrl.dev/pool": "cpu"} and pod["tolerations"] == [
        {"key": "spotrl.dev/pool", "operator": "Exists"}
    ]


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (
            {"model": {"existingClaim": "reward-models"}, "function": {"reference": "/app/rewards.py:compute_score"}},
            "set one of reward.model.existingClaim (a reward model) and reward.function.reference (your reward function), not both",
        ),
        (
            {},
            "reward.enabled needs reward.model.existingClaim (a PVC with a reward model) or reward.function.reference",
        ),
        (
            {"function": {"reference": "/app/rewards.py:compute_score"}, "image": {"repository": "rewards"}},
            "reward.image.tag or reward.image.digest is required with reward.image.repository",
        ),
        (
            {"function": {"reference": "/app/rewards.py:compute_score", "memoryMb": 0}},
            "needs reward.function.resources",
        ),
    ],
    ids=["both", "neither", "image-unpinned", "no-memory-limit"],
)
def test_reward_service_refuses_what_it_cannot_run(reward: dict[str, Any], message: str) -> None:
    values = scenario("minimal-trial-values.yaml")
    values["reward"] = {"enabled": True} | reward
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_service_monitor() -> None:
    docs = render(scenario("production-values.yaml"))
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"] == by_kind(docs, "Service")["spotrl-api"]["spec"]["selector"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    # The series keep their own pod/instance labels: the dashboards join spotrl_pod_info{pod} to
    # DCGM_FI_DEV_GPU_UTIL{pod}, which a scrape target's pod label would break.
    assert endpoint["honorLabels"] is True
    # /metrics needs an admin token: the operator's Secret holds the token itself.
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "spotrl-metrics-token", "key": "token"},
    }


BAD_VALUES = [
    ({"s3": {"url": "https://bucket/prefix"}}, "/s3/url"),
    ({"unknownKey": 1}, "additional properties 'unknownKey'"),
    ({"api": {"replicas": -1}}, "/api/replicas"),
    ({"api": {"replica": 3}}, "additional properties 'replica'"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"podSecurityContext": {"runAsNonRoot": False}}, "/podSecurityContext/runAsNonRoot"),
    (
        {"containerSecurityContext": {"allowPrivilegeEscalation": True}},
        "/containerSecurityContext/allowPrivilegeEscalation",
    ),
    ({"auth": {"tokens": {"me": {"sha256": "not-a-hash", "tenant": "a"}}}}, "/auth/tokens/me/sha256"),
    ({"auth": {"tokens": {"me": {"token": "plain-text-token", "tenant": "a"}}}}, "additional properties 'token'"),
    ({"backends": {"queueUrl": "localhost:9092"}}, "/backends/queueUrl"),
    ({"settings": {"keepPolicyVersions": 1}}, "/settings/keepPolicyVersions"),
    ({"settings": {"extraEnv": {"lower_case": "x"}}}, "'lower_case' does not match"),
    ({"pools": {"rollout": {"nodeSelector": {"spot": True}, "tolerations": []}}}, "/pools/rollout/nodeSelector/spot"),
    (
        {"pools": {"training": {"tolerations": [{"key": "a", "effect": "Sometimes"}], "nodeSelector": {}}}},
        "/pools/training/tolerations/0/effect",
    ),
    ({"trial": {"postgresql": {"enabled": True, "password": "short"}}}, "/trial/postgresql/password"),
    ({"reward": {"function": {"workers": 0}}}, "/reward/function/workers"),
    ({"reward": {"function": {"batched": "yes"}}}, "/reward/function/batched"),
    ({"reward": {"image": {"digest": "latest"}}}, "/reward/image/digest"),
    ({"reward": {"model": {"path": "../../etc"}}}, "/reward/model/path"),
    ({"priceCatalog": {"instances": {"x1": {"gpu": "A10G", "gpus": 1}}}}, "/priceCatalog/instances/x1"),
    ({"api": {"resources": {"limits": {"memory": "lots"}}}}, "/api/resources/limits/memory"),
]


@pytest.mark.parametrize(("change", "named"), BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_schema_rejects_bad_values(change: dict[str, Any], named: str) -> None:
    chart = helm.Chart.load(CHART)
    base = scenario("minimal-trial-values.yaml")
    chart.validate_schema(base)  # the scenario alone is fine
    values = helm.Chart.load(CHART).merge_values(base)  # coalesced like an install, then the bad change on top
    with pytest.raises(helm.HelmValuesError, match=re.escape(named)):
        chart.validate_schema(_merge(values, change))


def _merge(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in change.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) and value else value
        )
    return out


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("auth", "auth.tokens"),
        ("trial", "backends.stateUrl"),
    ],
)
def test_missing_required_settings_fail_with_the_key_named(drop: str, message: str) -> None:
    values = scenario("minimal-trial-values.yaml")
    del values[drop]
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize(("name", "warns"), [("minimal-trial-values.yaml", True), ("production-values.yaml", False)])
def test_notes_warn_of_trial_backends(name: str, warns: bool) -> None:
    manifests = helm.Chart.load(CHART).render(scenario(name), name=RELEASE, namespace=NAMESPACE, is_install=True)
    notes = manifests["spotrl/templates/NOTES.txt"]
    assert ("WARNING: trial backends" in notes) is warns
    assert ("https://spotrl.acme.example" in notes) is (name == "production-values.yaml")


def test_extra_env_cannot_shadow_a_chart_setting() -> None:
    values = scenario("minimal-trial-values.yaml")
    values["settings"] = {"extraEnv": {"SPOTRL_DATA_DIRS": "/data"}}
    assert settings_env(render(values))["SPOTRL_DATA_DIRS"] == "/data"
    values["settings"] = {"extraEnv": {"SPOTRL_LAUNCHER": "local"}}
    with pytest.raises(helm.HelmError, match="settings.extraEnv.SPOTRL_LAUNCHER"):
        render(values)


def test_insecure_no_auth_is_explicit() -> None:
    values = scenario("minimal-trial-values.yaml")
    values["auth"] = {"insecureNoAuth": True}
    docs = render(values)
    (api,) = containers(by_kind(docs, "Deployment")["spotrl-api"])
    assert "--insecure-no-auth" in api["args"] and "SPOTRL_TOKENS_FILE" not in settings_env(docs)
    assert "spotrl-tokens" not in by_kind(docs, "Secret")


def test_dashboards_become_sidecar_configmaps(tmp_path: Path) -> None:
    chart = tmp_path / "spotrl"
    shutil.copytree(CHART, chart)
    for old in (chart / "dashboards").glob("*.json"):  # another branch's dashboards, if merged
        old.unlink()
    values = scenario("minimal-trial-values.yaml")
    assert [
        d for d in render(values, chart) if "dashboard" in d["metadata"]["name"]
    ] == []  # an empty folder renders nothing
    cost = {"title": "spotrl cost", "panels": [{"targets": [{"expr": "sum(spotrl_run_cost_dollars_total)"}]}]}
    (chart / "dashboards/Cost_Overview.json").write_text(json.dumps(cost))
    (chart / "dashboards/pipeline.json").write_text(json.dumps({"title": "spotrl pipeline", "panels": []}))
    (chart / "dashboards/notes.txt").write_text("not a dashboard")
    maps = {n: d for n, d in by_kind(render(values, chart), "ConfigMap").items() if "-dashboard-" in n}
    assert set(maps) == {"spotrl-dashboard-cost-overview", "spotrl-dashboard-pipeline"}
    cm = maps["spotrl-dashboard-cost-overview"]
    assert (
        cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        and cm["metadata"]["annotations"]["grafana_folder"] == "spotrl"
    )
    assert json.loads(cm["data"]["Cost_Overview.json"]) == cost
    for doc in maps.values():
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    values["dashboards"] = {"enabled": False}
    assert not [n for n in by_kind(render(values, chart), "ConfigMap") if "-dashboard-" in n]


def test_the_charts_own_dashboards_each_become_a_configmap() -> None:
    """The dashboards in the chart (deploy/grafana writes them), one valid sidecar ConfigMap each."""
    files = sorted((CHART / "dashboards").glob("*.json"))
    maps = {
        n: d
        for n, d in by_kind(render(scenario("minimal-trial-values.yaml")), "ConfigMap").items()
        if "-dashboard-" in n
    }
    assert set(maps) == {f"spotrl-dashboard-{f.stem}" for f in files}
    for f in files:
        cm = maps[f"spotrl-dashboard-{f.stem}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"][f.name]) == json.loads(f.read_text())
        assert len(f.read_bytes()) < 1 << 20  # a ConfigMap holds at most 1 MiB


def test_long_release_names_stay_within_63_characters() -> None:
    release = "a-release-name-of-exactly-fifty-three-characters-long"
    assert len(release) == 53
    docs = render(scenario("minimal-trial-values.yaml"), release=release)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert all(len(n) <= 63 and not n.endswith("-") for _, n in names), [n for _, n in names if len(n) > 63]
    assert len(set(names)) == len(names), "truncation made two objects' names collide"
    for labels in [d["metadata"]["labels"] for d in docs]:
        assert all(len(v) <= 63 for v in labels.values())


def _param_paths() -> list[str]:
    return re.findall(r"^\s*## @param (\S+) ", (CHART / "values.yaml").read_text(), flags=re.MULTILINE)


def _key_paths(values: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths.append(path)
        if isinstance(value, dict):
            paths += _key_paths(value, f"{path}.")
    return paths


def test_every_value_is_documented() -> None:
    """Each key of values.yaml is a `## @param` (or inside one, for maps documented whole), each
    @param names a real key, the schema knows every key, and the README's table lists every @param."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    params = _param_paths()
    keys = _key_paths(values)
    assert len(params) == len(set(params))
    assert set(params) <= set(keys), set(params) - set(keys)
    for key in keys:
        documented = any(key == p or key.startswith(f"{p}.") for p in params)
        parent = any(p.startswith(f"{key}.") for p in params)  # a section whose keys are documented one by one
        assert documented or parent, f"values.yaml key {key} has no ## @param"
    readme = (CHART / "README.md").read_text()
    assert not [p for p in params if f"`{p}`" not in readme], "README.md misses parameters"
    schema = json.loads((CHART / "values.schema.json").read_text())
    for key in [k for k in keys if any(k == p for p in params)]:
        node = schema
        for part in key.split("."):
            node = node["properties"][part]
        assert node, key


# policy/v1 PodDisruptionBudget arrived in Kubernetes 1.21, after the test server's v1.20 (which
# has only policy/v1beta1); the ServiceMonitor's CRD is not installed there. Both are still
# validated (the PDBs against 1.30 and 1.37 above) and their fields asserted.
NOT_ON_V1_20 = {("policy/v1", "PodDisruptionBudget"), ("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_creates_on_a_real_api_server(name: str, kube) -> None:
    """Every rendered object is created on a real kube-apiserver (v1.20, tests/servers/kube.py)
    through the dynamic client, so the server's own validation judges the raw manifest, and what
    it stores keeps every field sent: v1.20 silently drops fields it does not know."""
    from kubernetes.dynamic import DynamicClient

    namespace = kube.new_namespace()
    docs = render(scenario(name), namespace=namespace)
    with kube.api_client() as api:
        dynamic = DynamicClient(api)
        created = 0
        for doc in docs:
            if (doc["apiVersion"], doc["kind"]) in NOT_ON_V1_20:
                continue
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            stored = resource.create(body=doc, namespace=namespace if resource.namespaced else None).to_dict()
            _assert_kept(doc, stored, f"{doc['kind']}/{doc['metadata']['name']}")
            created += 1
        assert created == len([d for d in docs if (d["apiVersion"], d["kind"]) not in NOT_ON_V1_20])
        # The server's defaulting ran on the real objects: a Deployment has its strategy, a Service its cluster IP.
        scheduler = dynamic.resources.get(api_version="apps/v1", kind="Deployment").get(
            name="spotrl-scheduler", namespace=namespace
        )
        assert scheduler.spec.strategy.type == "RollingUpdate"
        api_service = dynamic.resources.get(api_version="v1", kind="Service").get(
            name="spotrl-api", namespace=namespace
        )
        assert api_service.spec.clusterIP


def test_reward_function_creates_on_a_real_api_server(kube) -> None:
    """The function mode's reward Deployment and Service, as the v1.20 server stores them."""
    from kubernetes.dynamic import DynamicClient

    namespace = kube.new_namespace()
    docs = [
        d
        for d in render(reward_function_values(batched=True), namespace=namespace)
        if d["metadata"]["name"] == "spotrl-reward" and d["kind"] in {"Deployment", "Service"}
    ]
    assert len(docs) == 2
    with kube.api_client() as api:
        dynamic = DynamicClient(api)
        for doc in docs:
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            _assert_kept(doc, resource.create(body=doc, namespace=namespace).to_dict(), f"{doc['kind']}/spotrl-reward")


def _assert_kept(sent: Any, stored: Any, where: str) -> None:
    """``sent`` is contained in ``stored``, allowing for the server's normal forms (quantities as strings, Secret data base64)."""
    if isinstance(sent, dict):
        assert isinstance(stored, dict), where
        for key, value in sent.items():
            if key == "stringData":  # write-only: the server stores it base64-encoded under data
                decoded = {k: base64.b64decode(v).decode() for k, v in stored["data"].items()}
                assert decoded == value, where
                continue
            assert key in stored, f"{where}: the server dropped {key}"
            _assert_kept(value, stored[key], f"{where}.{key}")
    elif isinstance(sent, list):
        assert isinstance(stored, list) and len(stored) == len(sent), where
        for i, (a, b) in enumerate(zip(sent, stored, strict=True)):
            _assert_kept(a, b, f"{where}[{i}]")
    elif isinstance(stored, str) and isinstance(sent, int | float) and not isinstance(sent, bool):
        assert stored == str(sent), where  # a quantity: 1 GPU is stored as "1"
    else:
        assert stored == sent, f"{where}: sent {sent!r}, stored {stored!r}"
