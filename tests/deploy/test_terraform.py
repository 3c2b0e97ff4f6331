"""infra/terraform, checked offline (`terraform init`/`validate` need the provider registry, which
these machines cannot reach): `terraform fmt`, a python-hcl2 parse of every file with assertions
on what the cluster must be (the node pools' labels, taints, capacity types and families that the
Helm chart relies on, the training pool at zero when idle, the bucket's versioning, encryption and
lifecycle, Pod Identity for the chart's service accounts, the image repositories, the opt-in
backends' network and encryption, documented variables and outputs); the module's locals and its
`helm_values` output evaluated by `terraform apply` on a copy (resources and data sources stubbed)
and checked against their consumers: the chart rendered with them, NVIDIA's device plugin and
dcgm-exporter charts' scheduling rules against the GPU pools' nodes, Grafana's sidecar settings
against the chart's dashboards, the backends' URLs parsed by spotrl's own adapters, and
`make push` (with a stand-in `docker`) feeding the chart each image's digest; and checkov, with
the defaults and with every opt-in part on: no failed check, and every skip justified where it
applies.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import hcl2
import helm_python as helm
import pytest
import redis
import yaml
from kafka.net.sasl import get_sasl_mechanism
from sqlalchemy import make_url

from services.core.config import Settings
from services.ports.launcher.kubernetes_objects import Machine, job_manifest, pod_manifest
from services.ports.launcher.launcher import PodSpec
from services.ports.queue.kafka_settings import KafkaSettings
from services.ports.reward_cache.redis_reward_cache import SCHEMES as REDIS_SCHEMES
from services.ports.state.state_engine import create_state_engine
from services.ports.wiring import kubernetes_config

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "infra" / "terraform"
EXAMPLE = TF / "examples" / "complete"
CHART = ROOT / "deploy" / "helm" / "spotrl"
POOL_KEY = "spotrl.dev/pool"
GPU_POOLS = {"rollout", "training", "reward"}  # always there; the spot training pool is opt-in
# Each Karpenter NodePool's pool label: the spot training pool shares the training pool's.
POOL_LABELS = {"rollout": "rollout", "training": "training", "training-spot": "training", "reward": "reward"}
IMAGES = {"control": "spotrl-control", "rollout": "spotrl-rollout", "training": "spotrl-training"}
# Inputs a caller must give; every other variable has a default.
REQUIRED_VARIABLES = {TF: {"vpc_id", "subnet_ids"}, EXAMPLE: {"endpoint_public_access_cidrs"}}


@cache
def parse(folder: Path) -> dict[str, list[Any]]:
    """Every .tf file of the folder merged: block type -> list of blocks."""
    options = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)
    merged: dict[str, list[Any]] = {}
    for path in sorted(folder.glob("*.tf")):
        with path.open() as f:
            for kind, blocks in hcl2.load(f, serialization_options=options).items():
                merged.setdefault(kind, []).extend(blocks)
    return merged


def parse_file(path: Path) -> dict[str, list[Any]]:
    """One .tf file: block type -> list of blocks."""
    options = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)
    with path.open() as f:
        return hcl2.load(f, serialization_options=options)


def named(folder: Path, kind: str) -> dict[str, Any]:
    """variable/output/module blocks by name."""
    return {name: body for block in parse(folder).get(kind, []) for name, body in block.items()}


def resources(folder: Path, kind: str = "resource") -> dict[tuple[str, str], Any]:
    return {
        (rtype, name): body
        for block in parse(folder).get(kind, [])
        for rtype, by_name in block.items()
        for name, body in by_name.items()
    }


def local(name: str) -> Any:
    for block in parse(TF)["locals"]:
        if name in block:
            return block[name]
    raise KeyError(name)


def with_defaults(value: Any) -> Any:
    """The value with each whole `${var.NAME}` replaced by that variable's default."""
    if isinstance(value, dict):
        return {k: with_defaults(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_defaults(v) for v in value]
    if isinstance(value, str) and (m := re.fullmatch(r"\$\{var\.(\w+)\}", value)):
        return named(TF, "variable")[m.group(1)]["default"]
    return value


def terraform_command() -> str:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.fail("terraform is not on PATH (TEST-INFRA.md: these machines have terraform 1.11)")
    return terraform


def test_terraform_fmt() -> None:
    terraform = terraform_command()
    result = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-diff", str(TF)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("folder", [TF, EXAMPLE], ids=["module", "example"])
def test_variables_and_outputs_are_documented(folder: Path) -> None:
    variables = named(folder, "variable")
    assert variables
    for name, body in variables.items():
        assert body.get("description"), f"variable {name} has no description"
        assert "type" in body, f"variable {name} has no type"
        assert ("default" in body) != (name in REQUIRED_VARIABLES[folder]), f"variable {name}: default"
    outputs = named(folder, "output")
    for name, body in outputs.items():
        assert body.get("description"), f"output {name} has no description"
    for name in (
        "cluster_name",
        "cluster_endpoint",
        "region",
        "bucket_name",
        "objects_url",
        "spotrl_role_arn",
        "spotrl_namespace",
        "helm_release_name",
        "spotrl_service_accounts",
        "node_pools",
        "helm_values",
        "image_registry",
        "image_repository_urls",
        "backends_secret_name",
        "metrics_token_secret_name",
        "grafana_admin_password",
    ):
        assert name in outputs, f"{folder.name} does not output {name}"
    if folder == TF:
        # Module outputs of resources go through try(), as terraform-aws-eks does.
        for name in (
            "cluster_name",
            "cluster_endpoint",
            "bucket_name",
            "spotrl_role_arn",
            "postgres_endpoint",
            "kafka_bootstrap_brokers",
            "redis_endpoint",
            "grafana_admin_password",
        ):
            assert outputs[name]["value"].startswith("${try("), name


def test_gpu_pools_labels_taints_capacity_and_families() -> None:
    pools = with_defaults(local("gpu_pools"))
    assert set(pools) == set(POOL_LABELS)
    expected = {
        "rollout": (["spot"], ["g5", "g6"], True),
        "training": (["on-demand"], ["p4d", "p5"], True),
        "training-spot": (["spot"], ["p4d", "p5"], False),
        "reward": (["on-demand"], ["g4dn"], True),
    }
    for name, (capacity_types, families, enabled) in expected.items():
        pool = pools[name]
        assert pool["capacity_types"] == capacity_types, name
        assert pool["instance_families"] == families, name
        assert pool["enabled"] is enabled, name
        assert pool["labels"] == {POOL_KEY: POOL_LABELS[name]}
        assert pool["taints"] == [{"key": POOL_KEY, "value": POOL_LABELS[name], "effect": "NoSchedule"}]
        assert pool["gpu_limit"] > 0


@pytest.mark.parametrize("name", ["training", "training-spot"])
def test_training_pools_scale_to_zero_and_are_not_disrupted_while_busy(name: str) -> None:
    training = with_defaults(local("gpu_pools"))[name]
    # Karpenter only creates nodes for pending pods; empty ones go after consolidate_after.
    assert training["consolidation_policy"] == "WhenEmpty"
    assert re.fullmatch(r"\d+s", training["consolidate_after"]) and int(training["consolidate_after"][:-1]) <= 60
    blocking = [b for b in training["budgets"] if b["nodes"] == "0"]
    assert blocking and "Drifted" in blocking[0]["reasons"] and "Empty" not in blocking[0]["reasons"]


def test_the_spot_training_pool_is_opt_in() -> None:
    variables = named(TF, "variable")
    assert variables["training_spot_enabled"]["default"] is False
    assert variables["training_spot_gpu_limit"]["default"] > 0
    off, on = evaluate(), evaluate(training_spot_enabled="true")
    assert set(off["node_pool_labels"]) == GPU_POOLS and set(off["pool_scheduling"]) == GPU_POOLS | {"system"}
    assert set(on["node_pool_labels"]) == GPU_POOLS | {"training-spot"}
    assert on["pool_scheduling"]["training-spot"] == {
        "capacity_types": ["spot"],
        "node_selector": {POOL_KEY: "training"},
        "tolerations": [{"key": POOL_KEY, "operator": "Equal", "value": "training", "effect": "NoSchedule"}],
    }
    # The chart knows no such pool: its pods take the training pool's settings.
    assert set(on["helm_values"]["pools"]) == {"capacityLabel", "rollout", "training", "reward"}
    assert on["helm_values"] == off["helm_values"]


def test_node_pool_manifests_come_from_the_pools() -> None:
    node_pool = resources(TF)[("kubectl_manifest", "gpu_node_pool")]
    assert node_pool["for_each"] == "${local.gpu_pools_enabled}"
    assert local("gpu_pools_enabled") == "${{for name, pool in local.gpu_pools : name => pool if pool.enabled}}"
    body = node_pool["yaml_body"]
    for fragment in (
        'apiVersion = "karpenter.sh/v1"',
        'kind = "NodePool"',
        "labels = local.node_pool_labels[each.key]",
        "taints = each.value.taints",
        '{key = "karpenter.sh/capacity-type", operator = "In", values = each.value.capacity_types}',
        '{key = "karpenter.k8s.aws/instance-family", operator = "In", values = each.value.instance_families}',
        '"nvidia.com/gpu" = each.value.gpu_limit',
        "consolidationPolicy = each.value.consolidation_policy",
        'name = "spotrl-gpu"',
    ):
        assert fragment in body, fragment
    # No static replicas: a NodePool with none holds zero nodes until a pod needs one.
    assert "replicas" not in body
    node_class = resources(TF)[("kubectl_manifest", "gpu_node_class")]["yaml_body"]
    assert 'httpTokens = "required"' in node_class and "httpPutResponseHopLimit = 1" in node_class
    assert "encrypted = true" in node_class


def test_system_node_group_is_on_demand_untainted_and_hosts_karpenter() -> None:
    eks = named(TF, "module")["eks"]
    assert eks["source"] == "terraform-aws-modules/eks/aws"
    system = eks["eks_managed_node_groups"]["system"]
    assert system["capacity_type"] == "ON_DEMAND"
    assert "taints" not in system
    assert system["labels"] == {POOL_KEY: "system", "karpenter.sh/controller": "true"}
    assert with_defaults(system["min_size"]) >= 1
    assert eks["addons"]["eks-pod-identity-agent"]["before_compute"] is True
    karpenter = named(TF, "module")["karpenter"]
    assert karpenter["source"] == "terraform-aws-modules/eks/aws//modules/karpenter"
    assert karpenter["version"] == eks["version"]
    assert karpenter["enable_spot_termination"] is True


def test_bucket_versioning_encryption_public_access_and_lifecycle() -> None:
    res = resources(TF)
    versioning = res[("aws_s3_bucket_versioning", "this")]["versioning_configuration"][0]
    assert versioning["status"] == "Enabled"
    sse = res[("aws_s3_bucket_server_side_encryption_configuration", "this")]["rule"][0]
    assert sse["apply_server_side_encryption_by_default"][0]["sse_algorithm"] == "aws:kms"
    assert res[("aws_kms_key", "bucket")]["enable_key_rotation"] is True
    block = res[("aws_s3_bucket_public_access_block", "this")]
    assert all(
        block[k] is True
        for k in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets")
    )

    rules = {r["id"]: with_defaults(r) for r in res[("aws_s3_bucket_lifecycle_configuration", "this")]["rule"]}
    assert all(r["status"] == "Enabled" for r in rules.values())
    checkpoints = rules["old-checkpoints"]
    assert checkpoints["filter"] == [{"prefix": "runs/"}]
    assert checkpoints["transition"][0]["storage_class"] == "STANDARD_IA" and checkpoints["transition"][0]["days"] >= 30
    assert checkpoints["noncurrent_version_expiration"][0]["noncurrent_days"] > 0
    assert (
        rules["abort-incomplete-multipart-uploads"]["abort_incomplete_multipart_upload"][0]["days_after_initiation"] > 0
    )


def test_the_charts_service_accounts_get_the_bucket_through_pod_identity() -> None:
    res = resources(TF)
    association = res[("aws_eks_pod_identity_association", "spotrl")]
    # One association per service account of the chart (evaluated in test_helm_values_feed_the_chart).
    assert association["for_each"] == "${local.spotrl_service_accounts}"
    assert association["service_account"] == "${each.value}"
    assert with_defaults(association["namespace"]) == "spotrl"
    assert association["role_arn"] == "${aws_iam_role.spotrl.arn}"
    assert named(TF, "variable")["helm_release_name"]["default"] == "spotrl"
    assume = resources(TF, "data")[("aws_iam_policy_document", "spotrl_assume")]["statement"][0]
    assert assume["principals"][0]["identifiers"] == ["pods.eks.amazonaws.com"]
    assert set(assume["actions"]) == {"sts:AssumeRole", "sts:TagSession"}
    objects = resources(TF, "data")[("aws_iam_policy_document", "spotrl_objects")]["statement"]
    granted = {action: statement["resources"] for statement in objects for action in statement["actions"]}
    assert granted["s3:GetObject"] == granted["s3:PutObject"] == ["${aws_s3_bucket.this.arn}/*"]
    assert granted["s3:ListBucket"] == ["${aws_s3_bucket.this.arn}"]
    assert "*" not in str(granted.values()).replace("/*", "")


def top_level_blocks(path: Path, header: str) -> list[str]:
    """The text of each top-level block of a .tf file whose first line starts with ``header``
    (terraform fmt puts a top-level block's closing brace alone at the start of a line)."""
    return re.findall(rf"^{re.escape(header)}.*?^\}}$", path.read_text(), flags=re.M | re.S)


# What the scratch copy puts in place of each resource attribute and data source the evaluated
# locals and outputs read (AWS's formats: ECR repository URLs, MSK's SCRAM listeners on 9096, ...).
ACCOUNT, REGION = "123456789012", "us-west-2"
STUBS = {
    "data.aws_region.current.region": f'"{REGION}"',
    "data.aws_caller_identity.current.account_id": f'"{ACCOUNT}"',
    "data.aws_partition.current.partition": '"aws"',
    "aws_s3_bucket.this.id": f'"spotrl-{ACCOUNT}-{REGION}"',
    'aws_ecr_repository.this["control"].repository_url': f'"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/${{var.name}}/spotrl-control"',
    "random_password.postgres[0].result": '"Pg0postgresPassword"',
    "aws_db_instance.this[0].address": f'"spotrl-spotrl.c9akciq32.{REGION}.rds.amazonaws.com"',
    "aws_db_instance.this[0].port": "5432",
    "aws_msk_cluster.this[0].bootstrap_brokers_sasl_scram": (
        f'"b-1.spotrlspotrl.x1y2z3.c2.kafka.{REGION}.amazonaws.com:9096,b-2.spotrlspotrl.x1y2z3.c2.kafka.{REGION}.amazonaws.com:9096"'
    ),
    "random_password.kafka[0].result": '"Kf0kafkaPassword"',
    "random_password.redis[0].result": '"Rd0redisAuthToken0123456789"',
    "aws_elasticache_replication_group.this[0].primary_endpoint_address": '"master.spotrl-spotrl.abc123.usw2.cache.amazonaws.com"',
    "aws_elasticache_replication_group.this[0].port": "6379",
}
# Outputs of the module evaluated as they are, and locals evaluated through an output of their own.
EVALUATED_OUTPUTS = (
    "helm_values",
    "spotrl_service_accounts",
    "image_registry",
    "backends_secret_name",
    "metrics_token_secret_name",
)
EVALUATED_LOCALS = (
    "images",
    "node_pool_labels",
    "pool_scheduling",
    "nvidia_device_plugin_values",
    "dcgm_exporter_values",
    "kube_prometheus_stack_values",
    "backends_env",
    "grafana_folder_annotation",
)
# The opt-in parts, all on.
EVERYTHING_ON = {"create_backends": "true", "enable_kube_prometheus_stack": "true", "training_spot_enabled": "true"}


def evaluate(release: str = "spotrl", **variables: str) -> dict[str, Any]:
    """The module's outputs and locals above as `terraform apply` computes them, for a release name
    and variables: its variables, every locals block, and those outputs, with the resource
    attributes and data sources they read stubbed (STUBS), applied offline in a scratch folder."""
    return _evaluate(release, tuple(sorted(variables.items())))


@cache
def _evaluate(release: str, variables: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    parts = [(TF / "variables.tf").read_text()]
    for path in sorted(TF.glob("*.tf")):
        parts += top_level_blocks(path, "locals {")
    for name in EVALUATED_OUTPUTS:
        (block,) = top_level_blocks(TF / "outputs.tf", f'output "{name}" {{')
        parts.append(block)
    parts += [f'output "local_{name}" {{\n  value = local.{name}\n}}' for name in EVALUATED_LOCALS]
    text = "\n\n".join(parts)
    for ref, stub in STUBS.items():
        text = text.replace(ref, stub)
    terraform = terraform_command()
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    arguments = {
        "vpc_id": "vpc-1",
        "subnet_ids": '["subnet-1","subnet-2","subnet-3","subnet-4"]',
        "helm_release_name": release,
        **dict(variables),
    }
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "main.tf").write_text(text)

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([terraform, *args], cwd=scratch, env=env, capture_output=True, text=True, timeout=120)

        apply = [
            "apply",
            "-input=false",
            "-auto-approve",
            *(a for k, v in arguments.items() for a in ("-var", f"{k}={v}")),
        ]
        for args in (["init", "-input=false"], apply):
            result = run(*args)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        result = run("output", "-json")
        assert result.returncode == 0, result.stderr
    return {name.removeprefix("local_"): output["value"] for name, output in json.loads(result.stdout).items()}


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of two values files: maps key by key, anything else replaced by the later file."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def render_by_kind(values: dict[str, Any], release: str) -> dict[str, dict[str, Any]]:
    """The chart's manifests for these values, by kind and name."""
    manifests = helm.Chart.load(CHART).render(values, name=release, namespace="spotrl", is_install=True)
    kinds: dict[str, dict[str, Any]] = {}
    for path, text in manifests.items():
        for doc in yaml.safe_load_all(text) if not path.endswith("NOTES.txt") else ():
            if doc:
                kinds.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    return kinds


def release_service_accounts(kinds: dict[str, dict[str, Any]]) -> set[str]:
    """The release's service accounts, less Helm hooks' (which exist only while a hook runs, such as
    the uninstall's teardown, and use no bucket)."""
    return {
        name
        for name, sa in kinds["ServiceAccount"].items()
        if "helm.sh/hook" not in sa["metadata"].get("annotations", {})
    }


def users_values(backends_from_terraform: bool) -> dict[str, Any]:
    """What a user adds to Terraform's values: the trial scenario's token, and its in-chart
    backends unless Terraform made the production ones; the bucket is Terraform's (no keys)."""
    values = yaml.safe_load((CHART / "ci" / "minimal-trial-values.yaml").read_text())
    del values["s3"]
    if backends_from_terraform:
        del values["trial"]
    return values


@pytest.mark.parametrize(
    ("release", "variables"), [("spotrl", EVERYTHING_ON), ("research", {})], ids=["everything-on", "defaults"]
)
def test_helm_values_feed_the_chart(release: str, variables: dict[str, str]) -> None:
    """The chart installed with `terraform output -json helm_values` (and the rest of a user's values)
    runs its pods as exactly the service accounts that have Pod Identity associations, on the bucket,
    pulls the images from the module's registry, launches each role onto its Terraform pool, and,
    with the backends on, reads their Secret in every pod, launched ones included."""
    outputs = evaluate(release, **variables)
    values, accounts = outputs["helm_values"], outputs["spotrl_service_accounts"]
    assert set(accounts) == {"api", "scheduler", "workload"}
    backends = "create_backends" in variables
    user = users_values(backends)
    # `helm install <release> -f terraform-values.yaml -f values.yaml`: the later file wins.
    kinds = render_by_kind(merged(values, user), release)
    assert release_service_accounts(kinds) == set(accounts.values())
    # helm_values pins fullnameOverride; the module's names follow the chart's own naming without it too.
    unpinned = render_by_kind(merged({k: v for k, v in values.items() if k != "fullnameOverride"}, user), release)
    assert release_service_accounts(unpinned) == set(accounts.values())
    registry = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/spotrl"
    assert values["image"] == {"registry": registry} and outputs["image_registry"] == registry
    for component in ("api", "scheduler"):
        # The Deployment and its service account share the chart's component name.
        pod = kinds["Deployment"][accounts[component]]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == accounts[component]
        assert pod["nodeSelector"] == {POOL_KEY: "system"}
        assert pod["containers"][0]["image"].startswith(f"{registry}/spotrl-control:")
    (settings,) = (cm["data"] for name, cm in kinds["ConfigMap"].items() if name.endswith("-settings"))
    assert settings["SPOTRL_KUBE_SERVICE_ACCOUNT"] == accounts["workload"]
    assert settings["SPOTRL_OBJECTS_URL"] == f"s3://spotrl-{ACCOUNT}-{REGION}"
    assert settings["AWS_REGION"] == REGION
    assert settings["SPOTRL_KUBE_ROLLOUT_IMAGE"].startswith(f"{registry}/spotrl-rollout:")
    assert settings["SPOTRL_KUBE_TRAINING_IMAGE"].startswith(f"{registry}/spotrl-training:")

    def toleration(pool: str) -> list[dict]:
        return [{"key": POOL_KEY, "operator": "Equal", "value": pool, "effect": "NoSchedule"}]

    capacity = {
        "rollout": {"karpenter.sh/capacity-type": "spot"},
        "training": {"karpenter.sh/capacity-type": "on-demand"},
    }
    for pool in ("rollout", "training"):  # the launcher's pools, handed to it as settings
        assert json.loads(settings[f"SPOTRL_KUBE_{pool.upper()}_NODE_SELECTOR"]) == {POOL_KEY: pool, **capacity[pool]}
        assert json.loads(settings[f"SPOTRL_KUBE_{pool.upper()}_TOLERATIONS"]) == toleration(pool)
    # The reward pool is the chart's own reward service's.
    with_reward = merged(
        merged(values, user), {"reward": {"enabled": True, "model": {"existingClaim": "rm", "path": "rm-v1"}}}
    )
    reward = next(
        d for name, d in render_by_kind(with_reward, release)["Deployment"].items() if name.endswith("-reward")
    )
    pod = reward["spec"]["template"]["spec"]
    assert pod["nodeSelector"][POOL_KEY] == "reward" and pod["tolerations"] == toleration("reward")

    # The backends: Terraform's Secret, not the chart's, in the control plane's and the launched pods' environment.
    secret_names = set(kinds["Secret"])
    if backends:
        assert values["backends"] == {"existingSecret": outputs["backends_secret_name"]}
        assert outputs["backends_secret_name"] not in secret_names and not [
            n for n in secret_names if n.endswith("-backends")
        ]
        assert outputs["backends_secret_name"] in settings["SPOTRL_KUBE_ENV_SECRETS"].split(",")
        pod = kinds["Deployment"][accounts["scheduler"]]["spec"]["template"]["spec"]
        assert {"secretRef": {"name": outputs["backends_secret_name"]}} in pod["containers"][0]["envFrom"]
    else:
        assert "backends" not in values and outputs.get("backends_secret_name") is None  # a null output is left out
        assert "serviceMonitor" not in values and "ServiceMonitor" not in kinds


# ---------------------------------------------------------------------------------------------
# The GPU DaemonSets: NVIDIA's device plugin and dcgm-exporter land on every GPU pool's nodes
# ---------------------------------------------------------------------------------------------

# NVIDIA's device plugin chart 0.18.0, deployments/helm/nvidia-device-plugin/values.yaml
# (github.com/NVIDIA/k8s-device-plugin, tag v0.18.0): the DaemonSet's scheduling defaults, which
# templates/daemonset-device-plugin.yml renders as they are. Without one of these three node labels
# the plugin never runs and no node advertises nvidia.com/gpu.
DEVICE_PLUGIN_0_18_0_DEFAULTS: dict[str, Any] = {
    "nodeSelector": {},
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In", "values": ["true"]}
                        ]
                    },
                    {
                        "matchExpressions": [
                            {
                                "key": "feature.node.kubernetes.io/cpu-model.vendor_id",
                                "operator": "In",
                                "values": ["NVIDIA"],
                            }
                        ]
                    },
                    {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]},
                ]
            }
        }
    },
    "tolerations": [
        {"key": "CriticalAddonsOnly", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ],
}
# NVIDIA's dcgm-exporter chart 4.8.2, deployment/values.yaml (github.com/NVIDIA/dcgm-exporter, tag
# 4.5.3-4.8.2): a DaemonSet on every node unless told otherwise, and a ServiceMonitor, on by
# default, whose endpoint's honorLabels is serviceMonitor.honorLabels (templates/service-monitor.yaml).
DCGM_EXPORTER_4_8_2_DEFAULTS: dict[str, Any] = {
    "nodeSelector": {},
    "affinity": {},
    "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}],
    "serviceMonitor": {"enabled": True, "honorLabels": False, "interval": "15s"},
}


def schedules_onto(pod: dict[str, Any], labels: dict[str, str], taints: list[dict[str, str]]) -> bool:
    """Whether the scheduler places a DaemonSet's pod on a node: its nodeSelector, its required node
    affinity (terms ORed, expressions ANDed) and a toleration for every NoSchedule taint."""
    if any(labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False

    def holds(expression: dict[str, Any]) -> bool:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        return {
            "In": lambda: labels.get(key) in values,
            "NotIn": lambda: labels.get(key) not in values,
            "Exists": lambda: key in labels,
            "DoesNotExist": lambda: key not in labels,
        }[operator]()

    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required and not any(
        all(holds(e) for e in term.get("matchExpressions", [])) for term in required["nodeSelectorTerms"]
    ):
        return False

    def tolerates(toleration: dict[str, str], taint: dict[str, str]) -> bool:
        if toleration.get("effect") and toleration["effect"] != taint["effect"]:
            return False
        if toleration.get("operator", "Equal") == "Exists":
            return not toleration.get("key") or toleration["key"] == taint["key"]
        return toleration.get("key") == taint["key"] and toleration.get("value") == taint.get("value")

    return all(any(tolerates(t, taint) for t in pod.get("tolerations") or []) for taint in taints)


def test_scheduling_model_refuses_what_kubernetes_refuses() -> None:
    pod = {
        "nodeSelector": {"a": "1"},
        "tolerations": [{"key": "t", "operator": "Equal", "value": "x", "effect": "NoSchedule"}],
    }
    assert schedules_onto(pod, {"a": "1"}, [{"key": "t", "value": "x", "effect": "NoSchedule"}])
    assert not schedules_onto(pod, {"a": "2"}, [])
    assert not schedules_onto(pod, {"a": "1"}, [{"key": "t", "value": "y", "effect": "NoSchedule"}])
    assert not schedules_onto(DEVICE_PLUGIN_0_18_0_DEFAULTS, {}, [])
    assert schedules_onto(DEVICE_PLUGIN_0_18_0_DEFAULTS, {"feature.node.kubernetes.io/pci-10de.present": "true"}, [])


def gpu_nodes() -> dict[str, tuple[dict[str, str], list[dict[str, str]]]]:
    """Each node kind's labels and taints: what Karpenter gives each GPU pool's nodes (the NodePool
    template's labels, evaluated, and its taints; every pool on) and the system node group's."""
    labels = evaluate(training_spot_enabled="true")["node_pool_labels"]
    pools = with_defaults(local("gpu_pools"))
    assert set(labels) == set(POOL_LABELS)
    nodes = {name: (labels[name], pools[name]["taints"]) for name in POOL_LABELS}
    nodes["system"] = (named(TF, "module")["eks"]["eks_managed_node_groups"]["system"]["labels"], [])
    return nodes


def test_device_plugin_runs_on_every_gpu_pool_and_only_there() -> None:
    # The affinity above is the pinned release's; another release needs it read again.
    assert named(TF, "variable")["nvidia_device_plugin_chart_version"]["default"] == "0.18.0"
    values = evaluate()["nvidia_device_plugin_values"]
    release = resources(TF)[("helm_release", "nvidia_device_plugin")]
    assert release["values"] == ["${yamlencode(local.nvidia_device_plugin_values)}"]
    assert release["chart"] == "nvidia-device-plugin"
    pod = merged(DEVICE_PLUGIN_0_18_0_DEFAULTS, values)  # Helm's coalescing of the chart's defaults and ours
    for name, (labels, taints) in gpu_nodes().items():
        assert schedules_onto(pod, labels, taints) == (name != "system"), name


# An instance type of each GPU pool's families, and its machine (the price catalog's).
INSTANCE_TYPES = {
    "g5.xlarge": Machine(gpus=1, vcpus=4, memory_gib=16),
    "p4d.24xlarge": Machine(gpus=8, vcpus=96, memory_gib=1152),
    "g4dn.xlarge": Machine(gpus=1, vcpus=4, memory_gib=16),
}


@pytest.mark.parametrize("spot_training", [True, False], ids=["spot-training-pool", "defaults"])
def test_the_launchers_pods_land_on_their_terraform_pool(spot_training: bool, monkeypatch) -> None:
    """The scheduler's launcher, configured by the chart installed with Terraform's values, against
    the nodes Karpenter would make for each NodePool (its labels and taints, the capacity type and
    an instance type of its families): a spot training pod lands only on the spot training pool, an
    on-demand one only on the training pool, a rollout worker only on the rollout pool. Without the
    spot training pool a spot training pod has no node to go to."""
    outputs = evaluate(**({"training_spot_enabled": "true"} if spot_training else {}))
    kinds = render_by_kind(merged(outputs["helm_values"], users_values(False)), "spotrl")
    (settings,) = (cm["data"] for name, cm in kinds["ConfigMap"].items() if name.endswith("-settings"))
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    cfg = kubernetes_config(Settings())
    pools = with_defaults(local("gpu_pools"))
    nodes = {
        (name, capacity, instance_type): (
            {**labels, "karpenter.sh/capacity-type": capacity, "node.kubernetes.io/instance-type": instance_type},
            pools[name]["taints"],
        )
        for name, labels in outputs["node_pool_labels"].items()
        for capacity in outputs["pool_scheduling"][name]["capacity_types"]
        for instance_type in INSTANCE_TYPES
        if instance_type.split(".")[0] in pools[name]["instance_families"]
    }

    def landing(role: str, instance_type: str, capacity: str) -> set[tuple[str, str]]:
        spec = PodSpec(f"run-1-{role}-0", "run-1", role, ["spotrl"], {}, instance_type, capacity)
        manifest = (job_manifest if role == "training" else pod_manifest)(spec, cfg, INSTANCE_TYPES[instance_type], {})
        pod = manifest["spec"]["template"]["spec"] if role == "training" else manifest["spec"]
        return {(name, cap) for (name, cap, _), node in nodes.items() if schedules_onto(pod, *node)}

    assert landing("training", "p4d.24xlarge", "spot") == ({("training-spot", "spot")} if spot_training else set())
    assert landing("training", "p4d.24xlarge", "on-demand") == {("training", "on-demand")}
    assert landing("rollout", "g5.xlarge", "spot") == {("rollout", "spot")}
    assert landing("rollout", "p4d.24xlarge", "spot") == set()  # not a rollout family


@pytest.mark.parametrize("variables", [EVERYTHING_ON, {}], ids=["with-kube-prometheus-stack", "defaults"])
def test_dcgm_exporter_runs_on_the_gpu_pools_and_keeps_the_pod_label(variables: dict[str, str]) -> None:
    assert named(TF, "variable")["dcgm_exporter_chart_version"]["default"] == "4.8.2"
    assert named(TF, "variable")["enable_dcgm_exporter"]["default"] is True
    release = resources(TF)[("helm_release", "dcgm_exporter")]
    assert release["values"] == ["${yamlencode(local.dcgm_exporter_values)}"]
    assert release["depends_on"] == ["${helm_release.kube_prometheus_stack}", "${helm_release.nvidia_device_plugin}"]
    values = evaluate(**variables)["dcgm_exporter_values"]
    pod = merged(DCGM_EXPORTER_4_8_2_DEFAULTS, values)
    for name, (labels, taints) in gpu_nodes().items():
        assert schedules_onto(pod, labels, taints) == (name != "system"), name
    # The dashboards join DCGM's series to spotrl's pods on `pod`: the scrape must keep the
    # exporter's own `pod` label (the GPU's pod), not replace it with the exporter pod's name.
    assert pod["serviceMonitor"]["honorLabels"] is True
    joins = [
        e
        for f in (CHART / "dashboards").glob("*.json")
        for e in re.findall(r'"expr": "([^"]*DCGM_FI_DEV_GPU_UTIL[^"]*)"', f.read_text())
    ]
    assert joins and all("on (pod)" in e for e in joins)
    # A ServiceMonitor needs the Prometheus Operator's CRDs: only with kube-prometheus-stack (or the user's, by choice).
    assert pod["serviceMonitor"]["enabled"] is bool(variables)


def test_kube_prometheus_stack_finds_the_charts_dashboards_and_metrics() -> None:
    """Grafana's sidecar, as Terraform sets it up, picks up the chart's dashboard ConfigMaps (in
    another namespace) into their folder, and Prometheus the chart's ServiceMonitor."""
    assert named(TF, "variable")["enable_kube_prometheus_stack"]["default"] is False
    outputs = evaluate("spotrl", **EVERYTHING_ON)
    stack, values = outputs["kube_prometheus_stack_values"], outputs["helm_values"]
    sidecar = stack["grafana"]["sidecar"]["dashboards"]
    assert sidecar["enabled"] is True and sidecar["searchNamespace"] == "ALL"
    # folderAnnotation names the folder; with foldersFromFilesStructure the provider makes it a Grafana folder.
    assert (
        sidecar["folderAnnotation"] == outputs["grafana_folder_annotation"]
        and sidecar["provider"]["foldersFromFilesStructure"] is True
    )
    assert stack["prometheus"]["prometheusSpec"]["serviceMonitorSelectorNilUsesHelmValues"] is False
    assert named(TF, "variable")["monitoring_namespace"]["default"] != "spotrl"  # hence searchNamespace ALL
    kinds = render_by_kind(merged(values, users_values(True)), "spotrl")
    dashboards = {name: cm["metadata"] for name, cm in kinds["ConfigMap"].items() if "-dashboard-" in name}
    assert len(dashboards) == len(list((CHART / "dashboards").glob("*.json")))
    for metadata in dashboards.values():
        assert metadata["labels"][sidecar["label"]] == sidecar["labelValue"]
        assert metadata["annotations"][sidecar["folderAnnotation"]] == values["dashboards"]["folder"] == "spotrl"
    (monitor,) = kinds["ServiceMonitor"].values()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True
    assert endpoint["authorization"]["credentials"]["name"] == outputs["metrics_token_secret_name"]


# ---------------------------------------------------------------------------------------------
# Images: a repository per image, `make push`, the chart running each image by digest
# ---------------------------------------------------------------------------------------------


def test_an_immutable_scanned_repository_per_image() -> None:
    repository = resources(TF)[("aws_ecr_repository", "this")]
    assert repository["for_each"] == "${local.images}"
    assert repository["name"] == "${local.image_repository_prefix}/${each.value}"
    assert local("image_repository_prefix") == "${var.name}"
    assert repository["image_tag_mutability"] == "IMMUTABLE"
    assert repository["image_scanning_configuration"] == [{"scan_on_push": True}]
    assert repository["encryption_configuration"] == [{"encryption_type": "KMS"}]
    assert named(TF, "variable")["ecr_force_delete"]["default"] is False
    assert evaluate()["images"] == IMAGES
    # The images are the ones the Makefile builds from docker/ and the chart runs.
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^IMAGES := (.*)$", makefile, re.M).group(1).split() == list(IMAGES)
    chart_images = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
    for key, image in IMAGES.items():
        assert (ROOT / "docker" / f"{key}.Dockerfile").is_file()
        assert re.search(rf"^image-{key}:.*\n\t.* -f docker/{key}\.Dockerfile -t {image}:", makefile, re.M), key
        assert chart_images[key]["repository"] == image


STAND_IN_DOCKER = r"""#!/bin/sh
# A stand-in for docker/podman: records each call; a push "stores" the image under the sha256 of its reference.
echo "$*" >> "$STAND_IN_LOG"
digest() { printf 'sha256:%s' "$(printf %s "$1" | sha256sum | cut -c1-64)"; }
case "$1" in
  --version) echo "$STAND_IN_VERSION" ;;
  push) [ "$2" = --digestfile ] && digest "$4" > "$3" ;;
  image) ref="$5"; echo "mirror.example/other@sha256:0123456789abcdef0123456789abcdef"; echo "${ref%:*}@$(digest "$ref")" ;;
esac
exit 0
"""


def make_push(tmp_path: Path, version: str, **variables: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    make = shutil.which("make")
    if make is None:
        pytest.fail("make is not on PATH")
    docker, log = tmp_path / "docker", tmp_path / "calls.log"
    docker.write_text(STAND_IN_DOCKER)
    docker.chmod(0o755)
    log.write_text("")
    env = {**os.environ, "STAND_IN_LOG": str(log), "STAND_IN_VERSION": version}
    command = [make, "-s", "-C", str(ROOT), "push", f"DOCKER={docker}", *(f"{k}={v}" for k, v in variables.items())]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    return result, log.read_text().splitlines()


@pytest.mark.parametrize(
    "version", ["Docker version 28.2.2, build e6534b4", "podman version 5.4.0"], ids=["docker", "podman"]
)
def test_make_push_gives_the_chart_each_images_digest(tmp_path: Path, version: str) -> None:
    """`make push REGISTRY=$(terraform output -raw image_registry)` builds, pushes and records what
    the registry holds; the chart, given Terraform's values and those, runs every image by digest
    from its ECR repository."""
    outputs = evaluate()
    registry, tag = outputs["image_registry"], "0123abcd4567"
    values_file = tmp_path / "out" / "images-values.yaml"
    result, calls = make_push(tmp_path, version, REGISTRY=registry, IMAGE_TAG=tag, IMAGES_VALUES=values_file)
    assert result.returncode == 0, result.stdout + result.stderr
    builds = [i for i, c in enumerate(calls) if c.startswith("build ")]
    pushes = {c.split()[-1]: i for i, c in enumerate(calls) if c.startswith("push ")}
    assert len(builds) == 3 and all("--platform linux/amd64" in calls[i] for i in builds)
    assert set(pushes) == {f"{registry}/{image}:{tag}" for image in IMAGES.values()}
    assert max(builds) < min(pushes.values())
    pushed = yaml.safe_load(values_file.read_text())
    expected = {
        key: "sha256:" + hashlib.sha256(f"{registry}/{image}:{tag}".encode()).hexdigest()
        for key, image in IMAGES.items()
    }
    assert pushed == {
        "image": {"registry": registry, "tag": tag, **{key: {"digest": d} for key, d in expected.items()}}
    }

    kinds = render_by_kind(merged(merged(outputs["helm_values"], pushed), users_values(False)), "spotrl")
    # The ECR repository of each image: `<registry host>/<name>/<image>` (repository_url's form).
    ecr = {key: f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/spotrl/{image}" for key, image in IMAGES.items()}
    want = {key: f"{ecr[key]}:{tag}@{expected[key]}" for key in IMAGES}
    (settings,) = (cm["data"] for name, cm in kinds["ConfigMap"].items() if name.endswith("-settings"))
    for deployment in kinds["Deployment"].values():
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] in ("api", "scheduler"):
            assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == want["control"]
    assert settings["SPOTRL_KUBE_ROLLOUT_IMAGE"] == settings["SPOTRL_KUBE_REWARD_IMAGE"] == want["rollout"]
    assert settings["SPOTRL_KUBE_TRAINING_IMAGE"] == want["training"]


def test_make_push_needs_a_registry_before_building(tmp_path: Path) -> None:
    result, calls = make_push(tmp_path, "Docker version 28.2.2", REGISTRY="")
    assert result.returncode != 0 and "REGISTRY=" in result.stderr
    assert calls == []


# ---------------------------------------------------------------------------------------------
# Backends (create_backends): private, encrypted, reached by spotrl's adapters as written
# ---------------------------------------------------------------------------------------------


def test_backends_secret_is_what_spotrls_adapters_read() -> None:
    """The Secret Terraform writes (URLs and SCRAM user, evaluated with AWS's endpoint formats)
    holds every key the chart's own backends Secret would, and each URL parses in the adapter that
    reads it: Kafka settings to SASL_SSL with SCRAM-SHA-512 (kafka-python's SCRAM client built from
    them), Redis over TLS with the auth token, PostgreSQL through psycopg with TLS required."""
    env = evaluate("spotrl", **EVERYTHING_ON)["backends_env"]
    trial = yaml.safe_load((CHART / "ci" / "minimal-trial-values.yaml").read_text())
    chart_secret = next(d for n, d in render_by_kind(trial, "spotrl")["Secret"].items() if n.endswith("-backends"))
    assert {k for k in chart_secret["stringData"] if k.startswith("SPOTRL_")} <= set(env)

    kafka = KafkaSettings.from_url(env["SPOTRL_QUEUE_URL"], env=env)
    assert [s.rsplit(":", 1)[1] for s in kafka.bootstrap_servers] == ["9096", "9096"]  # MSK's SASL/SCRAM listener
    assert kafka.security == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "spotrl",
        "sasl_plain_password": "Kf0kafkaPassword",
    }
    assert "Kf0kafkaPassword" not in env["SPOTRL_QUEUE_URL"]  # URLs are logged: the password travels apart
    config = kafka.client_config()
    scram = get_sasl_mechanism(config["sasl_mechanism"])(**config)
    assert scram.auth_bytes().startswith(b"n,,n=spotrl,r=")

    cache_url = env["SPOTRL_REWARD_CACHE_URL"]
    assert cache_url.split("://")[0] in REDIS_SCHEMES
    pool = redis.Redis.from_url(cache_url).connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["password"] == "Rd0redisAuthToken0123456789"
    assert pool.connection_kwargs["host"].endswith(".cache.amazonaws.com") and pool.connection_kwargs["port"] == 6379

    engine = create_state_engine(make_url(env["SPOTRL_STATE_URL"]))
    _, connect = engine.dialect.create_connect_args(engine.url)
    assert engine.url.drivername == "postgresql+psycopg"
    assert connect["sslmode"] == "require" and connect["dbname"] == "spotrl" and connect["user"] == "spotrl"
    assert connect["host"].endswith(".rds.amazonaws.com") and connect["port"] == 5432

    secret = resources(TF)[("kubectl_manifest", "backends_secret")]
    assert secret["count"] == "${local.backends_count}"
    for fragment in (
        'kind = "Secret"',
        "name = local.backends_secret_name",
        "namespace = var.spotrl_namespace",
        "data = {for key, value in local.backends_env : key => base64encode(value)}",
    ):
        assert fragment in secret["yaml_body"], fragment


def test_backends_are_opt_in_private_encrypted_and_open_to_the_nodes_only() -> None:
    assert named(TF, "variable")["create_backends"]["default"] is False
    res = resources(TF)
    backends_tf = parse_file(TF / "backends.tf")
    for block in backends_tf.get("resource", []) + backends_tf.get("data", []):
        for rtype, by_name in block.items():
            for name, body in by_name.items():
                gate = body.get("count") or body.get("for_each")
                assert (
                    gate in ("${local.backends_count}", "${aws_security_group.backends}")
                    or "if var.create_backends" in gate
                ), (rtype, name)

    # One security group per backend, its only rule: the nodes' group, on the backend's port.
    assert local("backend_ports") == {"postgres": 5432, "kafka": 9096, "redis": 6379}
    group = res[("aws_security_group", "backends")]
    assert "ingress" not in group and "egress" not in group
    rule = res[("aws_vpc_security_group_ingress_rule", "backends")]
    assert rule["for_each"] == "${aws_security_group.backends}"
    assert rule["referenced_security_group_id"] == "${module.eks.node_security_group_id}"
    assert rule["from_port"] == rule["to_port"] == "${local.backend_ports[each.key]}" and rule["ip_protocol"] == "tcp"
    assert not {"cidr_ipv4", "cidr_ipv6", "prefix_list_id"} & set(rule)
    # The nodes' group is the one Karpenter's GPU nodes carry too (the system node group gets it from the eks module).
    assert (
        "securityGroupSelectorTerms = [{id = module.eks.node_security_group_id}]"
        in res[("kubectl_manifest", "gpu_node_class")]["yaml_body"]
    )
    sg = lambda name: [f'${{aws_security_group.backends["{name}"].id}}']  # noqa: E731

    db = res[("aws_db_instance", "this")]
    assert db["vpc_security_group_ids"] == sg("postgres") and db["publicly_accessible"] is False
    assert db["storage_encrypted"] is True and db["kms_key_id"] == "${aws_kms_key.backends[0].arn}"
    assert db["engine"] == "postgres" and db["port"] == "${local.backend_ports.postgres}"
    parameters = {p["name"]: p["value"] for p in res[("aws_db_parameter_group", "this")]["parameter"]}
    assert parameters["rds.force_ssl"] == "1"

    msk = res[("aws_msk_cluster", "this")]
    brokers = msk["broker_node_group_info"][0]
    assert brokers["security_groups"] == sg("kafka")
    assert brokers["connectivity_info"][0]["public_access"] == [{"type": "DISABLED"}]
    assert msk["client_authentication"] == [{"unauthenticated": False, "sasl": [{"scram": True}]}]
    assert msk["encryption_info"][0]["encryption_in_transit"] == [{"client_broker": "TLS", "in_cluster": True}]
    # MSK takes SCRAM users only from secrets named AmazonMSK_* under a customer managed key.
    secret = res[("aws_secretsmanager_secret", "kafka")]
    assert secret["name_prefix"].startswith("AmazonMSK_") and secret["kms_key_id"] == "${aws_kms_key.backends[0].arn}"
    association = res[("aws_msk_scram_secret_association", "this")]
    assert association["cluster_arn"] == "${aws_msk_cluster.this[0].arn}"
    assert association["secret_arn_list"] == ["${aws_secretsmanager_secret.kafka[0].arn}"]
    assert "username = local.kafka_username" in res[("aws_secretsmanager_secret_version", "kafka")]["secret_string"]

    cache = res[("aws_elasticache_replication_group", "this")]
    assert cache["security_group_ids"] == sg("redis") and cache["engine"] == "redis"
    assert cache["transit_encryption_enabled"] is True and cache["at_rest_encryption_enabled"] is True
    assert cache["auth_token"] == "${random_password.redis[0].result}"
    assert res[("aws_kms_key", "backends")]["enable_key_rotation"] is True


def test_example_calls_the_module_with_its_vpc() -> None:
    modules = named(EXAMPLE, "module")
    spotrl = modules["spotrl"]
    assert spotrl["source"] == "../.."
    assert spotrl["vpc_id"] == "${module.vpc.vpc_id}" and spotrl["subnet_ids"] == "${module.vpc.private_subnets}"
    assert modules["vpc"]["source"] == "terraform-aws-modules/vpc/aws"
    providers = {name for block in parse(EXAMPLE)["provider"] for name in block}
    assert providers == {"aws", "helm", "kubectl"}
    # The switches the install and the teardown set on the example reach the module.
    module_variables = named(TF, "variable")
    for name in (
        "create_backends",
        "enable_kube_prometheus_stack",
        "training_spot_enabled",
        "bucket_force_destroy",
        "ecr_force_delete",
        "backends_deletion_protection",
    ):
        assert spotrl[name] == f"${{var.{name}}}", name
        assert named(EXAMPLE, "variable")[name]["default"] == module_variables[name]["default"], name


def test_readme_documents_the_pool_contract() -> None:
    readme = (TF / "README.md").read_text()
    for pool in sorted(GPU_POOLS):
        assert f"`{POOL_KEY}={pool}`" in readme and f"`{POOL_KEY}={pool}:NoSchedule`" in readme
    assert f"`{POOL_KEY}=system`" in readme
    assert "`spotrl-training-spot`" in readme and "`training_spot_enabled`" in readme


def test_install_section_uses_what_the_example_and_the_makefile_provide() -> None:
    """The README's install, followed on paper: every output it reads, every variable it sets and
    every make target it runs exists, the files it passes to helm are the ones make and terraform
    write, and it ends with the run's bill, then the teardown."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Install on Kubernetes") : readme.index("### What else is in the box")]
    outputs, variables = named(EXAMPLE, "output"), named(EXAMPLE, "variable")
    read = set(re.findall(r"\$TF output -(?:raw|json) (\w+)", section))
    assert {"cluster_name", "region", "helm_values", "image_registry"} <= read and read <= set(outputs), read - set(
        outputs
    )
    tfvars = re.search(r"<<'TFVARS'\n(.*?)\nTFVARS", section, re.S).group(1)
    assigned = set(re.findall(r"^(\w+)\s*=", tfvars, re.M)) | set(re.findall(r"-var (\w+)=", section))
    assert {"create_backends", "enable_kube_prometheus_stack", "bucket_force_destroy", "ecr_force_delete"} <= assigned
    assert assigned <= set(variables), assigned - set(variables)
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    assert set(re.findall(r"`?make (\w[\w-]*)", section)) <= targets
    images_values = re.search(r"^IMAGES_VALUES \?= (.*)$", makefile, re.M).group(1)
    install = re.search(r"helm install spotrl deploy/helm/spotrl .*?(?=\n```)", section, re.S).group(0)
    # Terraform's values first, then the pushed images' (they set image.registry too: the later file wins).
    assert install.index(".spotrl/terraform-values.yaml") < install.index(images_values)
    assert "$TF output -json helm_values > .spotrl/terraform-values.yaml" in section
    assert f"`{evaluate('spotrl', **EVERYTHING_ON)['backends_secret_name']}`" in section
    assert section.index("spotrl runs cost") < section.index("helm uninstall") < section.index("$TF destroy")


def checkov_command() -> str:
    for candidate in (
        os.environ.get("SPOTRL_CHECKOV"),
        str(ROOT / ".venv" / "checkov" / "bin" / "checkov"),
        shutil.which("checkov"),
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail("checkov is not installed: `make test` creates .venv/checkov (or set SPOTRL_CHECKOV)")


@cache
def checkov_report(var_file: str | None) -> dict[str, Any]:
    command = [
        checkov_command(),
        "-d",
        str(TF),
        "--framework",
        "terraform",
        "--skip-download",
        "--compact",
        "-o",
        "json",
    ]
    result = subprocess.run(
        [*command, *(["--var-file", var_file] if var_file else [])], capture_output=True, text=True, timeout=120
    )
    report = json.loads(result.stdout)
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
    assert failed == [] and report["summary"]["failed"] == 0, failed
    assert report["summary"]["passed"] > 50, "checkov checked next to nothing: did it find the .tf files?"
    assert result.returncode == 0, result.stderr[-2000:]
    return report


def test_checkov_passes_with_justified_skips(tmp_path: Path) -> None:
    """checkov with the defaults, and with every opt-in part on: checkov leaves out resources whose
    count is 0, so the backends and the monitoring stack are only checked with their switches on."""
    everything_on = tmp_path / "everything-on.tfvars"
    everything_on.write_text("".join(f"{k} = {v}\n" for k, v in EVERYTHING_ON.items()))
    with ThreadPoolExecutor(2) as pool:  # two checkov processes side by side
        defaults, on = pool.map(checkov_report, [None, str(everything_on)])

    def checked(report: dict[str, Any]) -> set[str]:
        return {c["resource"] for kind in ("passed_checks", "skipped_checks") for c in report["results"][kind]}

    for resource in (
        "aws_db_instance.this[0]",
        "aws_msk_cluster.this[0]",
        "aws_elasticache_replication_group.this[0]",
        "aws_secretsmanager_secret.kafka[0]",
        "aws_cloudwatch_log_group.kafka[0]",
    ):
        assert any(r.endswith(resource) for r in checked(on)), resource
    assert on["summary"]["passed"] > defaults["summary"]["passed"]
    # Each skip is an in-place comment with its reason, and every such comment is used.
    comments = {
        (m.group(1), m.group(2).strip())
        for path in TF.rglob("*.tf")
        for m in re.finditer(r"#checkov:skip=(CKV2?_\w+):(.*)", path.read_text())
    }
    assert all(len(reason) > 40 for _, reason in comments), comments
    skipped = {c["check_id"] for report in (defaults, on) for c in report["results"]["skipped_checks"]}
    assert skipped == {check for check, _ in comments}
