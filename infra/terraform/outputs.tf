################################################################################
# Cluster
################################################################################

output "cluster_name" {
  description = "Name of the EKS cluster (`aws eks update-kubeconfig --name ...`)"
  value       = try(module.eks.cluster_name, null)
}

output "cluster_endpoint" {
  description = "Endpoint of the cluster's Kubernetes API server"
  value       = try(module.eks.cluster_endpoint, null)
}

output "cluster_certificate_authority_data" {
  description = "Base64-encoded certificate of the cluster's certificate authority"
  value       = try(module.eks.cluster_certificate_authority_data, null)
}

output "region" {
  description = "AWS region of the cluster and the bucket"
  value       = data.aws_region.current.region
}

################################################################################
# Node pools (Helm values: nodeSelector and tolerations of each spotrl role)
################################################################################

output "node_pools" {
  description = "Per pool: the capacity types, the node labels to select (`nodeSelector`) and the taints to tolerate (`tolerations`, Kubernetes shape); system has no taint"
  value = {
    for name, pool in local.pool_scheduling : name => {
      capacity_types = pool.capacity_types
      node_selector  = pool.node_selector
      tolerations    = pool.tolerations
    }
  }
}

output "karpenter_node_pool_names" {
  description = "Names of the Karpenter NodePools, by spotrl pool"
  value       = { for name, pool in kubectl_manifest.gpu_node_pool : name => try(pool.name, null) }
}

################################################################################
# Object store and identity
################################################################################

output "bucket_name" {
  description = "Name of the checkpoint bucket"
  value       = try(aws_s3_bucket.this.id, null)
}

output "bucket_arn" {
  description = "ARN of the checkpoint bucket"
  value       = try(aws_s3_bucket.this.arn, null)
}

output "objects_url" {
  description = "spotrl's object store URL for this bucket (SPOTRL_OBJECTS_URL)"
  value       = try("s3://${aws_s3_bucket.this.id}", null)
}

output "spotrl_role_arn" {
  description = "ARN of the IAM role the spotrl service account assumes through EKS Pod Identity (no service-account annotation needed)"
  value       = try(aws_iam_role.spotrl.arn, null)
}

output "spotrl_namespace" {
  description = "Namespace the Pod Identity associations expect the Helm release in (`helm install -n ...`)"
  value       = var.spotrl_namespace
}

output "helm_release_name" {
  description = "Release name the Pod Identity associations were made for (`helm install <name>`)"
  value       = var.helm_release_name
}

output "spotrl_service_accounts" {
  description = "The chart's service accounts that get the bucket through EKS Pod Identity, by component (api, scheduler, workload)"
  value       = local.spotrl_service_accounts
}

################################################################################
# Helm values
################################################################################

output "helm_values" {
  description = "Values for deploy/helm/spotrl under the chart's own keys: `terraform output -json helm_values > terraform-values.yaml` (JSON is YAML), then `helm install -f terraform-values.yaml -f your-values.yaml`. The bucket (s3.url, s3.region), fullnameOverride (the service-account names the Pod Identity associations expect), each GPU pool's nodeSelector and tolerations, and the API and scheduler on the system pool"
  value = {
    fullnameOverride = local.helm_fullname
    s3 = {
      url    = try("s3://${aws_s3_bucket.this.id}", null)
      region = data.aws_region.current.region
    }
    # The chart adds karpenter.sh/capacity-type to the rollout (spot) and training (on-demand) selectors.
    pools = merge(
      { capacityLabel = "karpenter" },
      {
        for name in keys(local.gpu_pools) : name => {
          nodeSelector = local.pool_scheduling[name].node_selector
          tolerations  = local.pool_scheduling[name].tolerations
        }
      },
    )
    api       = { nodeSelector = local.pool_scheduling.system.node_selector }
    scheduler = { nodeSelector = local.pool_scheduling.system.node_selector }
  }
}
