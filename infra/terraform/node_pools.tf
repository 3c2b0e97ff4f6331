################################################################################
# GPU node pools: Karpenter NodePools on one EC2NodeClass
#
# Karpenter rather than managed node groups: it creates a node only for a pending pod, so every
# GPU pool is at zero until spotrl asks for it (no cluster-autoscaler, no min_size to keep), picks
# among all sizes of the allowed families at the best spot price and capacity, handles spot
# interruption notices, and removes a node once it is empty.
################################################################################

locals {
  # Each pool's label and taint are the contract with the Helm chart and the launcher: pods of a
  # pool select `spotrl.dev/pool=<pool>` and tolerate `spotrl.dev/pool=<pool>:NoSchedule`. The
  # spot training pool shares the training pool's; each pod's capacity affinity tells them apart.
  # `enabled`: whether its NodePool exists (`gpu_pools_enabled`).
  gpu_pools = {
    # Generation on preemptible A10G (g5) and L4 (g6) GPUs.
    rollout = {
      enabled           = true
      capacity_types    = ["spot"]
      instance_families = var.rollout_instance_families
      gpu_limit         = var.rollout_gpu_limit
      labels            = { "spotrl.dev/pool" = "rollout" }
      taints            = [{ key = "spotrl.dev/pool", value = "rollout", effect = "NoSchedule" }]
      # Rollout workers survive being moved (they hand back their batch on SIGTERM), so Karpenter
      # may also repack them onto fewer or cheaper nodes.
      consolidation_policy = "WhenEmptyOrUnderutilized"
      consolidate_after    = var.rollout_consolidate_after
      # Nothing stops Karpenter from replacing a drifted rollout node.
      budgets = [{ nodes = "20%" }]
    }
    # Training jobs on on-demand A100 (p4d) and H100 (p5) GPUs; at zero between iterations.
    training = {
      enabled           = true
      capacity_types    = ["on-demand"]
      instance_families = var.training_instance_families
      gpu_limit         = var.training_gpu_limit
      labels            = { "spotrl.dev/pool" = "training" }
      taints            = [{ key = "spotrl.dev/pool", value = "training", effect = "NoSchedule" }]
      # A node goes back as soon as its Job's pod is gone, and is never disrupted while a job runs.
      consolidation_policy = "WhenEmpty"
      consolidate_after    = var.training_consolidate_after
      budgets = [
        { nodes = "0", reasons = ["Drifted", "Underutilized"] },
        { nodes = "100%", reasons = ["Empty"] },
      ]
    }
    # Training jobs the scheduler puts on spot (a run's `training.capacity`: spot, or auto while
    # spot is the cheaper), on the training pool's families, label and taint: the launcher's
    # training settings serve both pools. A spot training pod asks for
    # karpenter.sh/capacity-type=spot, which only this pool's nodes carry, and an on-demand one
    # refuses it, so neither lands on the other's. Karpenter's interruption queue drains a
    # reclaimed node: the pod gets SIGTERM and its grace period (the spot notice) to checkpoint,
    # its Job fails, and the scheduler relaunches it. Off unless training_spot_enabled; at zero
    # between jobs, like the training pool.
    training-spot = {
      enabled              = var.training_spot_enabled
      capacity_types       = ["spot"]
      instance_families    = var.training_instance_families
      gpu_limit            = var.training_spot_gpu_limit
      labels               = { "spotrl.dev/pool" = "training" }
      taints               = [{ key = "spotrl.dev/pool", value = "training", effect = "NoSchedule" }]
      consolidation_policy = "WhenEmpty"
      consolidate_after    = var.training_consolidate_after
      # No consolidation or drift replacement under a running job; a spot reclaim is no disruption
      # a budget can hold back.
      budgets = [
        { nodes = "0", reasons = ["Drifted", "Underutilized"] },
        { nodes = "100%", reasons = ["Empty"] },
      ]
    }
    # The reward service's T4 GPUs (g4dn).
    reward = {
      enabled              = true
      capacity_types       = var.reward_capacity_types
      instance_families    = var.reward_instance_families
      gpu_limit            = var.reward_gpu_limit
      labels               = { "spotrl.dev/pool" = "reward" }
      taints               = [{ key = "spotrl.dev/pool", value = "reward", effect = "NoSchedule" }]
      consolidation_policy = "WhenEmpty"
      consolidate_after    = var.reward_consolidate_after
      budgets              = [{ nodes = "1" }]
    }
  }

  # Labels of every GPU node besides its pool's. NVIDIA's device plugin chart schedules its
  # DaemonSet only onto nodes carrying one of three labels (its values.yaml `affinity`, 0.18.0):
  # NFD's `feature.node.kubernetes.io/pci-10de.present` or `cpu-model.vendor_id`, or
  # `nvidia.com/gpu.present=true`, the one meant to be set by hand. Node Feature Discovery is not
  # installed here, so the GPU pools set the last themselves; dcgm-exporter selects it too.
  gpu_node_labels = { "nvidia.com/gpu.present" = "true" }

  # The pools that get a NodePool.
  gpu_pools_enabled = { for name, pool in local.gpu_pools : name => pool if pool.enabled }

  # What Karpenter puts on each GPU pool's nodes: the pool's label and the GPU label.
  node_pool_labels = { for name, pool in local.gpu_pools_enabled : name => merge(pool.labels, local.gpu_node_labels) }

  # Where each spotrl pool's pods go, in Kubernetes shape: the `node_pools` and `helm_values` outputs.
  pool_scheduling = merge(
    {
      system = {
        capacity_types = ["on-demand"]
        node_selector  = { (local.pool_label_key) = "system" }
        tolerations    = []
      }
    },
    {
      for name, pool in local.gpu_pools_enabled : name => {
        capacity_types = pool.capacity_types
        node_selector  = pool.labels
        tolerations    = [for t in pool.taints : { key = t.key, operator = "Equal", value = t.value, effect = t.effect }]
      }
    },
  )
}

resource "kubectl_manifest" "gpu_node_class" {
  yaml_body = yamlencode({
    apiVersion = "karpenter.k8s.aws/v1"
    kind       = "EC2NodeClass"
    metadata = {
      name = "spotrl-gpu"
    }
    spec = {
      role = module.karpenter.node_iam_role_name
      # Karpenter resolves the alias to the NVIDIA variant of the AL2023 AMI on GPU instances.
      amiSelectorTerms           = [{ alias = var.gpu_ami_alias }]
      subnetSelectorTerms        = [for id in var.subnet_ids : { id = id }]
      securityGroupSelectorTerms = [{ id = module.eks.node_security_group_id }]
      blockDeviceMappings = [{
        deviceName = "/dev/xvda"
        ebs = {
          # Room for the CUDA images (several GB each) and the model cache.
          volumeSize          = "${var.gpu_node_volume_size_gib}Gi"
          volumeType          = "gp3"
          encrypted           = true
          deleteOnTermination = true
        }
      }]
      # IMDSv2 only, one hop: pods get AWS credentials from Pod Identity, never from the node's role.
      metadataOptions = {
        httpEndpoint            = "enabled"
        httpProtocolIPv6        = "disabled"
        httpPutResponseHopLimit = 1
        httpTokens              = "required"
      }
      tags = local.tags
    }
  })

  depends_on = [helm_release.karpenter]
}

resource "kubectl_manifest" "gpu_node_pool" {
  for_each = local.gpu_pools_enabled

  yaml_body = yamlencode({
    apiVersion = "karpenter.sh/v1"
    kind       = "NodePool"
    metadata = {
      name = "spotrl-${each.key}"
    }
    spec = {
      template = {
        metadata = {
          labels = local.node_pool_labels[each.key]
        }
        spec = {
          nodeClassRef = {
            group = "karpenter.k8s.aws"
            kind  = "EC2NodeClass"
            name  = "spotrl-gpu"
          }
          taints = each.value.taints
          requirements = [
            { key = "karpenter.sh/capacity-type", operator = "In", values = each.value.capacity_types },
            { key = "karpenter.k8s.aws/instance-family", operator = "In", values = each.value.instance_families },
            { key = "kubernetes.io/arch", operator = "In", values = ["amd64"] },
            { key = "kubernetes.io/os", operator = "In", values = ["linux"] },
          ]
        }
      }
      # The ceiling on the pool's GPUs, and so on what it can spend per hour.
      limits = {
        "nvidia.com/gpu" = each.value.gpu_limit
      }
      disruption = {
        consolidationPolicy = each.value.consolidation_policy
        consolidateAfter    = each.value.consolidate_after
        budgets             = each.value.budgets
      }
    }
  })

  depends_on = [kubectl_manifest.gpu_node_class]
}
