output "cluster_name" {
  description = "Name of the EKS cluster"
  value       = module.spotrl.cluster_name
}

output "cluster_endpoint" {
  description = "Endpoint of the cluster's Kubernetes API server"
  value       = module.spotrl.cluster_endpoint
}

output "region" {
  description = "AWS region of the cluster and the bucket"
  value       = module.spotrl.region
}

output "node_pools" {
  description = "Per pool: capacity types, nodeSelector and tolerations for the Helm values"
  value       = module.spotrl.node_pools
}

output "bucket_name" {
  description = "Name of the checkpoint bucket"
  value       = module.spotrl.bucket_name
}

output "objects_url" {
  description = "SPOTRL_OBJECTS_URL for the Helm values"
  value       = module.spotrl.objects_url
}

output "spotrl_role_arn" {
  description = "IAM role of the spotrl service account (EKS Pod Identity)"
  value       = module.spotrl.spotrl_role_arn
}

output "spotrl_namespace" {
  description = "Namespace to install the Helm chart into"
  value       = module.spotrl.spotrl_namespace
}

output "helm_release_name" {
  description = "Release name to install the Helm chart as"
  value       = module.spotrl.helm_release_name
}

output "spotrl_service_accounts" {
  description = "The chart's service accounts that get the bucket through EKS Pod Identity"
  value       = module.spotrl.spotrl_service_accounts
}

output "helm_values" {
  description = "Values for the Helm chart: `terraform output -json helm_values > terraform-values.yaml`"
  value       = module.spotrl.helm_values
}

output "image_registry" {
  description = "Registry and path of the spotrl images: `make push REGISTRY=$(terraform output -raw image_registry)`"
  value       = module.spotrl.image_registry
}

output "image_repository_urls" {
  description = "URL of each image's ECR repository (control, rollout, training)"
  value       = module.spotrl.image_repository_urls
}

output "backends_secret_name" {
  description = "Kubernetes Secret holding the backends' URLs (the chart's backends.existingSecret); null without create_backends"
  value       = module.spotrl.backends_secret_name
}

output "metrics_token_secret_name" {
  description = "Secret the chart's ServiceMonitor reads an admin API token from, with kube-prometheus-stack"
  value       = module.spotrl.metrics_token_secret_name
}

output "monitoring_namespace" {
  description = "Namespace of dcgm-exporter and kube-prometheus-stack"
  value       = module.spotrl.monitoring_namespace
}

output "grafana_admin_password" {
  description = "Password of Grafana's admin user (kube-prometheus-stack)"
  value       = module.spotrl.grafana_admin_password
  sensitive   = true
}
