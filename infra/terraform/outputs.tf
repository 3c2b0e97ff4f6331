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
# Container images
################################################################################

output "image_registry" {
  description = "Registry and path of the spotrl images, `<account>.dkr.ecr.<region>.amazonaws.com/<name>`: `make push REGISTRY=...` and the chart's image.registry"
  value       = try(local.image_registry, null)
}

output "image_repository_urls" {
  description = "URL of each image's ECR repository, by the chart's image key (control, rollout, training)"
  value       = { for key, repository in aws_ecr_repository.this : key => try(repository.repository_url, null) }
}

################################################################################
# Backends (create_backends)
################################################################################

output "backends_secret_name" {
  description = "Name of the Kubernetes Secret, in spotrl_namespace, holding the backends' URLs and the Kafka SCRAM user (the chart's backends.existingSecret); null without create_backends"
  value       = var.create_backends ? local.backends_secret_name : null
}

output "postgres_endpoint" {
  description = "Address and port of the RDS PostgreSQL state store"
  value       = try(aws_db_instance.this[0].endpoint, null)
}

output "kafka_bootstrap_brokers" {
  description = "MSK brokers' SASL/SCRAM (TLS) listeners, comma-separated"
  value       = try(aws_msk_cluster.this[0].bootstrap_brokers_sasl_scram, null)
}

output "kafka_scram_secret_arn" {
  description = "ARN of the Secrets Manager secret holding the MSK SCRAM user (username, password)"
  value       = try(aws_secretsmanager_secret.kafka[0].arn, null)
}

output "redis_endpoint" {
  description = "Primary endpoint of the ElastiCache Redis reward cache (TLS, auth token)"
  value       = try(aws_elasticache_replication_group.this[0].primary_endpoint_address, null)
}

################################################################################
# Monitoring
################################################################################

output "monitoring_namespace" {
  description = "Namespace of dcgm-exporter and kube-prometheus-stack"
  value       = var.monitoring_namespace
}

output "grafana_admin_password" {
  description = "Password of Grafana's `admin` user (kube-prometheus-stack); null without it"
  value       = try(random_password.grafana[0].result, null)
  sensitive   = true
}

output "metrics_token_secret_name" {
  description = "Secret, in spotrl_namespace, that the chart's ServiceMonitor reads an admin API token from (key `token`) when helm_values turns it on"
  value       = local.metrics_token_secret_name
}

################################################################################
# Helm values
################################################################################

output "helm_values" {
  description = "Values for deploy/helm/spotrl under the chart's own keys: `terraform output -json helm_values > terraform-values.yaml` (JSON is YAML), then `helm install -f terraform-values.yaml -f images-values.yaml -f your-values.yaml`. fullnameOverride (the service-account names the Pod Identity associations expect), the images' registry (image.registry), the bucket (s3.url, s3.region), each GPU pool's nodeSelector and tolerations, the API and scheduler on the system pool; with create_backends, backends.existingSecret; with enable_kube_prometheus_stack, the API's ServiceMonitor and the dashboards as Grafana's sidecar looks for them"
  value = merge(
    {
      fullnameOverride = local.helm_fullname
      image            = { registry = try(local.image_registry, null) }
      s3 = {
        url    = try("s3://${aws_s3_bucket.this.id}", null)
        region = data.aws_region.current.region
      }
      # The chart adds karpenter.sh/capacity-type to the rollout (spot) and training (on-demand)
      # selectors; the launcher drops it from each pod's, whose own affinity names its capacity
      # type. The chart has no pool of spot training: its pods take the training pool's settings.
      pools = merge(
        { capacityLabel = "karpenter" },
        {
          for name in ["rollout", "training", "reward"] : name => {
            nodeSelector = local.pool_scheduling[name].node_selector
            tolerations  = local.pool_scheduling[name].tolerations
          }
        },
      )
      api       = { nodeSelector = local.pool_scheduling.system.node_selector }
      scheduler = { nodeSelector = local.pool_scheduling.system.node_selector }
    },
    { for key, value in { backends = { existingSecret = local.backends_secret_name } } : key => value if var.create_backends },
    { for key, value in local.monitoring_helm_values : key => value if var.enable_kube_prometheus_stack },
  )
}
