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
  value = merge(
    {
      system = {
        capacity_types = ["on-demand"]
        node_selector  = { (local.pool_label_key) = "system" }
        tolerations    = []
      }
    },
    {
      for name, pool in local.gpu_pools : name => {
        capacity_types = pool.capacity_types
        node_selector  = pool.labels
        tolerations    = [for t in pool.taints : { key = t.key, operator = "Equal", value = t.value, effect = t.effect }]
      }
    },
  )
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
  description = "Namespace the Pod Identity association expects spotrl in"
  value       = var.spotrl_namespace
}

output "spotrl_service_account" {
  description = "Service account name the Pod Identity association expects"
  value       = var.spotrl_service_account
}
