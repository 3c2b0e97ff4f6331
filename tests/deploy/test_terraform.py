"""infra/terraform, checked offline (`terraform init`/`validate` need the provider registry, which
these machines cannot reach): `terraform fmt`, a python-hcl2 parse of every file with assertions
on what the cluster must be (the node pools' labels, taints, capacity types and families that the
Helm chart relies on, the training pool at zero when idle, the bucket's versioning, encryption and
lifecycle, Pod Identity for the spotrl service account, documented variables and outputs), and
checkov: no failed check, and every skip justified where it applies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import hcl2
import pytest

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "infra" / "terraform"
EXAMPLE = TF / "examples" / "complete"
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


def test_terraform_fmt() -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.fail("terraform is not on PATH (TEST-INFRA.md: these machines have terraform 1.11)")
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
                 "spotrl_namespace", "spotrl_service_account", "node_pools"):
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


def test_spotrl_service_account_gets_the_bucket_through_pod_identity() -> None:
    res = resources(TF)
    association = res[("aws_eks_pod_identity_association", "spotrl")]
    assert with_defaults(association["service_account"]) == "spotrl"
    assert with_defaults(association["namespace"]) == "spotrl"
    assert association["role_arn"] == "${aws_iam_role.spotrl.arn}"
    assume = resources(TF, "data")[("aws_iam_policy_document", "spotrl_assume")]["statement"][0]
    assert assume["principals"][0]["identifiers"] == ["pods.eks.amazonaws.com"]
    assert set(assume["actions"]) == {"sts:AssumeRole", "sts:TagSession"}
    objects = resources(TF, "data")[("aws_iam_policy_document", "spotrl_objects")]["statement"]
    granted = {action: statement["resources"] for statement in objects for action in statement["actions"]}
    assert granted["s3:GetObject"] == granted["s3:PutObject"] == ["${aws_s3_bucket.this.arn}/*"]
    assert granted["s3:ListBucket"] == ["${aws_s3_bucket.this.arn}"]
    assert "*" not in str(granted.values()).replace("/*", "")


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
