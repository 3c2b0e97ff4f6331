data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_region" "current" {}

locals {
  # The node pools' label and taint key: the Helm chart (deploy/helm/spotrl) and the Kubernetes
  # launcher select and tolerate exactly these (README.md, "Node pools").
  pool_label_key = "spotrl.dev/pool"

  tags = merge(var.tags, {
    "spotrl.dev/cluster" = var.name
  })

  # Tolerations of the DaemonSets that must run on every GPU node (device plugin, dcgm-exporter):
  # the spotrl pools' taints, whatever the pool, and the usual `nvidia.com/gpu` taint.
  gpu_daemonset_tolerations = [
    { key = local.pool_label_key, operator = "Exists", effect = "NoSchedule" },
    { key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" },
  ]

  # No nodeSelector and no affinity: the chart's default affinity (nvidia.com/gpu.present and NFD's
  # labels) is what selects the GPU nodes. Replacing `tolerations` drops the chart's deprecated
  # CriticalAddonsOnly one.
  nvidia_device_plugin_values = {
    tolerations = local.gpu_daemonset_tolerations
  }
}

################################################################################
# EKS cluster and the system node group
################################################################################

module "eks" {
  #checkov:skip=CKV_TF_1:A Terraform Registry module, pinned to one release by `version`; a commit-hash source would bypass the registry and its release checksums.
  source  = "terraform-aws-modules/eks/aws"
  version = "21.19.0"

  name               = var.name
  kubernetes_version = var.kubernetes_version

  endpoint_public_access       = var.endpoint_public_access
  endpoint_public_access_cidrs = var.endpoint_public_access_cidrs

  # The identity running Terraform installs Karpenter and the node pools into the cluster.
  enable_cluster_creator_admin_permissions = true

  addons = {
    coredns = {}
    # EKS Pod Identity: how the spotrl service account (identity.tf) and Karpenter get AWS credentials.
    eks-pod-identity-agent = {
      before_compute = true
    }
    kube-proxy = {}
    vpc-cni = {
      before_compute = true
    }
  }

  vpc_id                   = var.vpc_id
  subnet_ids               = var.subnet_ids
  control_plane_subnet_ids = var.control_plane_subnet_ids

  # The system pool is a managed node group, not a Karpenter NodePool: Karpenter cannot run on
  # nodes it provisions itself. It also runs CoreDNS and spotrl's control plane (API, scheduler).
  eks_managed_node_groups = {
    system = {
      ami_type       = "AL2023_x86_64_STANDARD"
      capacity_type  = "ON_DEMAND"
      instance_types = var.system_instance_types

      min_size     = var.system_min_size
      max_size     = var.system_max_size
      desired_size = var.system_desired_size

      labels = {
        "spotrl.dev/pool" = "system"
        # Karpenter's controller is scheduled onto nodes with this label (main.tf, helm_release.karpenter).
        "karpenter.sh/controller" = "true"
      }
    }
  }

  tags = local.tags
}

################################################################################
# Karpenter: controller IAM, interruption queue, node role
################################################################################

module "karpenter" {
  #checkov:skip=CKV_TF_1:A Terraform Registry module, pinned to one release by `version`; a commit-hash source would bypass the registry and its release checksums.
  source  = "terraform-aws-modules/eks/aws//modules/karpenter"
  version = "21.19.0"

  cluster_name = module.eks.cluster_name

  # The EC2NodeClass (node_pools.tf) names this role.
  node_iam_role_use_name_prefix   = false
  node_iam_role_name              = "${var.name}-karpenter-node"
  create_pod_identity_association = true

  # The interruption queue receives EC2's two-minute spot notices: Karpenter cordons and drains the
  # node, so each rollout worker gets SIGTERM and hands back its batch before the instance goes.
  enable_spot_termination = true

  tags = local.tags
}

resource "helm_release" "karpenter" {
  namespace  = "kube-system"
  name       = "karpenter"
  repository = "oci://public.ecr.aws/karpenter"
  chart      = "karpenter"
  version    = var.karpenter_chart_version
  wait       = true

  values = [yamlencode({
    nodeSelector = {
      "karpenter.sh/controller" = "true"
    }
    dnsPolicy = "Default"
    settings = {
      clusterName       = module.eks.cluster_name
      clusterEndpoint   = module.eks.cluster_endpoint
      interruptionQueue = module.karpenter.queue_name
    }
    webhook = {
      enabled = false
    }
  })]
}

# Exposes nvidia.com/gpu on the GPU nodes (the AL2023 NVIDIA AMI has the driver and container
# toolkit, not the device plugin). The chart's own node affinity is kept: it admits nodes labelled
# `nvidia.com/gpu.present=true`, which every GPU pool's nodes are (node_pools.tf, gpu_node_labels).
resource "helm_release" "nvidia_device_plugin" {
  namespace  = "kube-system"
  name       = "nvidia-device-plugin"
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = var.nvidia_device_plugin_chart_version

  values = [yamlencode(local.nvidia_device_plugin_values)]

  depends_on = [helm_release.karpenter]
}
