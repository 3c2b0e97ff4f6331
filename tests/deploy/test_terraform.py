"""infra/terraform, checked offline (`terraform init`/`validate` need the provider registry, which
these machines cannot reach): `terraform fmt`, a python-hcl2 parse of every file with assertions
on what the cluster must be (the node pools' labels, taints, capacity types and families that the
Helm chart relies on, the training pool at zero when idle, the bucket's versioning, encryption and
lifecycle, Pod Identity for the chart's service accounts, documented variables and outputs), the
`helm_values` output evaluated by `terraform apply` on a copy of its locals and rendered with the
chart, and checkov: no failed check, and every skip justified where it applies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import hcl2
import helm_python as helm
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "infra" / "terraform"
EXAMPLE = TF / "examples" / "complete"
CHART = ROOT / "deploy" / "helm" / "spotrl"
POOL_KEY = "spotrl.dev/pool"
GPU_POOLS = {"rollout", "training", "reward"}
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
    result = subprocess.run([terraform, "fmt", "-check", "-recursive", "-diff", str(TF)], capture_output=True, text=True, timeout=60)
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
    for name in ("cluster_name", "cluster_endpoint", "region", "bucket_name", "objects_url", "spotrl_role_arn",
                 "spotrl_namespace", "helm_release_name", "spotrl_service_accounts", "node_pools", "helm_values"):
        assert name in outputs, f"{folder.name} does not output {name}"
    if folder == TF:
        # Module outputs of resources go through try(), as terraform-aws-eks does.
        for name in ("cluster_name", "cluster_endpoint", "bucket_name", "spotrl_role_arn"):
            assert outputs[name]["value"].startswith("${try("), name


def test_gpu_pools_labels_taints_capacity_and_families() -> None:
    pools = with_defaults(local("gpu_pools"))
    assert set(pools) == GPU_POOLS
    expected = {
        "rollout": (["spot"], ["g5", "g6"]),
        "training": (["on-demand"], ["p4d", "p5"]),
        "reward": (["on-demand"], ["g4dn"]),
    }
    for name, (capacity_types, families) in expected.items():
        pool = pools[name]
        assert pool["capacity_types"] == capacity_types, name
        assert pool["instance_families"] == families, name
        assert pool["labels"] == {POOL_KEY: name}
        assert pool["taints"] == [{"key": POOL_KEY, "value": name, "effect": "NoSchedule"}]
        assert pool["gpu_limit"] > 0


def test_training_pool_scales_to_zero_and_is_not_disrupted_while_busy() -> None:
    training = with_defaults(local("gpu_pools"))["training"]
    # Karpenter only creates nodes for pending pods; empty ones go after consolidate_after.
    assert training["consolidation_policy"] == "WhenEmpty"
    assert re.fullmatch(r"\d+s", training["consolidate_after"]) and int(training["consolidate_after"][:-1]) <= 60
    blocking = [b for b in training["budgets"] if b["nodes"] == "0"]
    assert blocking and "Drifted" in blocking[0]["reasons"] and "Empty" not in blocking[0]["reasons"]


def test_node_pool_manifests_come_from_the_pools() -> None:
    node_pool = resources(TF)[("kubectl_manifest", "gpu_node_pool")]
    assert node_pool["for_each"] == "${local.gpu_pools}"
    body = node_pool["yaml_body"]
    for fragment in (
        'apiVersion = "karpenter.sh/v1"', 'kind = "NodePool"', "labels = each.value.labels", "taints = each.value.taints",
        '{key = "karpenter.sh/capacity-type", operator = "In", values = each.value.capacity_types}',
        '{key = "karpenter.k8s.aws/instance-family", operator = "In", values = each.value.instance_families}',
        '"nvidia.com/gpu" = each.value.gpu_limit', "consolidationPolicy = each.value.consolidation_policy",
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
    assert all(block[k] is True for k in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"))

    rules = {r["id"]: with_defaults(r) for r in res[("aws_s3_bucket_lifecycle_configuration", "this")]["rule"]}
    assert all(r["status"] == "Enabled" for r in rules.values())
    checkpoints = rules["old-checkpoints"]
    assert checkpoints["filter"] == [{"prefix": "runs/"}]
    assert checkpoints["transition"][0]["storage_class"] == "STANDARD_IA" and checkpoints["transition"][0]["days"] >= 30
    assert checkpoints["noncurrent_version_expiration"][0]["noncurrent_days"] > 0
    assert rules["abort-incomplete-multipart-uploads"]["abort_incomplete_multipart_upload"][0]["days_after_initiation"] > 0


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


def evaluate_helm_outputs(release: str) -> dict[str, Any]:
    """`helm_values` and `spotrl_service_accounts` as `terraform apply` computes them, for a release
    name: the module's variables and locals (none reads a provider) and the two outputs, with the
    bucket and the region stubbed, applied offline in a scratch folder."""
    stubs = {"data.aws_region.current.region": '"us-west-2"', "aws_s3_bucket.this.id": '"spotrl-123456789012-us-west-2"'}
    parts = [(TF / "variables.tf").read_text()]
    for name in ("main.tf", "node_pools.tf", "identity.tf"):
        parts += top_level_blocks(TF / name, "locals {")
    for name in ("helm_values", "spotrl_service_accounts"):
        (block,) = top_level_blocks(TF / "outputs.tf", f'output "{name}" {{')
        for ref, stub in stubs.items():
            block = block.replace(ref, stub)
        parts.append(block)
    terraform = terraform_command()
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "main.tf").write_text("\n\n".join(parts))
        run = lambda *args: subprocess.run([terraform, *args], cwd=scratch, env=env, capture_output=True, text=True, timeout=120)  # noqa: E731
        for args in (["init", "-input=false"],
                     ["apply", "-input=false", "-auto-approve", "-var", "vpc_id=vpc-1", "-var", 'subnet_ids=["subnet-1"]',
                      "-var", f"helm_release_name={release}"]):  # fmt: skip
            result = run(*args)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        result = run("output", "-json")
        assert result.returncode == 0, result.stderr
    return {name: output["value"] for name, output in json.loads(result.stdout).items()}


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


@pytest.mark.parametrize("release", ["spotrl", "research"])
def test_helm_values_feed_the_chart(release: str) -> None:
    """The chart installed with `terraform output -json helm_values` (and the rest of a trial's values)
    runs its pods as exactly the service accounts that have Pod Identity associations, on the bucket,
    and launches each role onto its Terraform pool."""
    outputs = evaluate_helm_outputs(release)
    values, accounts = outputs["helm_values"], outputs["spotrl_service_accounts"]
    assert set(accounts) == {"api", "scheduler", "workload"}
    trial = yaml.safe_load((CHART / "ci" / "minimal-trial-values.yaml").read_text())
    del trial["s3"]  # the bucket comes from Terraform; with Pod Identity, no keys
    # `helm install <release> -f terraform-values.yaml -f values.yaml`: the later file wins.
    kinds = render_by_kind(merged(values, trial), release)
    assert set(kinds["ServiceAccount"]) == set(accounts.values())
    # helm_values pins fullnameOverride; the module's names follow the chart's own naming without it too.
    unpinned = render_by_kind(merged({k: v for k, v in values.items() if k != "fullnameOverride"}, trial), release)
    assert set(unpinned["ServiceAccount"]) == set(accounts.values())
    for component in ("api", "scheduler"):
        # The Deployment and its service account share the chart's component name.
        pod = kinds["Deployment"][accounts[component]]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == accounts[component]
        assert pod["nodeSelector"] == {POOL_KEY: "system"}
    (settings,) = (cm["data"] for name, cm in kinds["ConfigMap"].items() if name.endswith("-settings"))
    assert settings["SPOTRL_KUBE_SERVICE_ACCOUNT"] == accounts["workload"]
    assert settings["SPOTRL_OBJECTS_URL"] == "s3://spotrl-123456789012-us-west-2"
    assert settings["AWS_REGION"] == "us-west-2"
    def toleration(pool: str) -> list[dict]:
        return [{"key": POOL_KEY, "operator": "Equal", "value": pool, "effect": "NoSchedule"}]

    capacity = {"rollout": {"karpenter.sh/capacity-type": "spot"}, "training": {"karpenter.sh/capacity-type": "on-demand"}}
    for pool in ("rollout", "training"):  # the launcher's pools, handed to it as settings
        assert json.loads(settings[f"SPOTRL_KUBE_{pool.upper()}_NODE_SELECTOR"]) == {POOL_KEY: pool, **capacity[pool]}
        assert json.loads(settings[f"SPOTRL_KUBE_{pool.upper()}_TOLERATIONS"]) == toleration(pool)
    # The reward pool is the chart's own reward service's.
    with_reward = merged(merged(values, trial), {"reward": {"enabled": True, "model": {"existingClaim": "rm", "path": "rm-v1"}}})
    reward = next(d for name, d in render_by_kind(with_reward, release)["Deployment"].items() if name.endswith("-reward"))
    pod = reward["spec"]["template"]["spec"]
    assert pod["nodeSelector"][POOL_KEY] == "reward" and pod["tolerations"] == toleration("reward")


def test_example_calls_the_module_with_its_vpc() -> None:
    modules = named(EXAMPLE, "module")
    spotrl = modules["spotrl"]
    assert spotrl["source"] == "../.."
    assert spotrl["vpc_id"] == "${module.vpc.vpc_id}" and spotrl["subnet_ids"] == "${module.vpc.private_subnets}"
    assert modules["vpc"]["source"] == "terraform-aws-modules/vpc/aws"
    providers = {name for block in parse(EXAMPLE)["provider"] for name in block}
    assert providers == {"aws", "helm", "kubectl"}


def test_readme_documents_the_pool_contract() -> None:
    readme = (TF / "README.md").read_text()
    for pool in sorted(GPU_POOLS):
        assert f"`{POOL_KEY}={pool}`" in readme and f"`{POOL_KEY}={pool}:NoSchedule`" in readme
    assert f"`{POOL_KEY}=system`" in readme


def checkov_command() -> str:
    for candidate in (os.environ.get("SPOTRL_CHECKOV"), str(ROOT / ".venv" / "checkov" / "bin" / "checkov"), shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail("checkov is not installed: `make test` creates .venv/checkov (or set SPOTRL_CHECKOV)")


def test_checkov_passes_with_justified_skips() -> None:
    result = subprocess.run(
        [checkov_command(), "-d", str(TF), "--framework", "terraform", "--skip-download", "--compact", "-o", "json"],
        capture_output=True, text=True, timeout=120,
    )
    report = json.loads(result.stdout)
    summary = report["summary"]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
    assert failed == [] and summary["failed"] == 0, failed
    assert summary["passed"] > 50, "checkov checked next to nothing: did it find the .tf files?"
    assert result.returncode == 0, result.stderr[-2000:]
    # Each skip is an in-place comment with its reason, and every such comment is used.
    comments = {
        (m.group(1), m.group(2).strip())
        for path in TF.rglob("*.tf")
        for m in re.finditer(r"#checkov:skip=(CKV2?_\w+):(.*)", path.read_text())
    }
    assert all(len(reason) > 40 for _, reason in comments), comments
    skipped = {c["check_id"] for c in report["results"]["skipped_checks"]}
    assert skipped == {check for check, _ in comments}
