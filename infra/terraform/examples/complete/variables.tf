variable "region" {
  description = "AWS region to create the cluster in; pick one with g5/g6, p4d/p5 and g4dn capacity (us-east-1, us-west-2)"
  type        = string
  default     = "us-west-2"
}

variable "availability_zones" {
  description = "Availability zones of the VPC's subnets, in `region`: GPU spot capacity is scattered, so every zone widens the choice. Listed rather than discovered, so that a zone AWS adds later does not renumber the subnets"
  type        = list(string)
  default     = ["us-west-2a", "us-west-2b", "us-west-2c", "us-west-2d"]
}

variable "name" {
  description = "Name of the cluster, VPC and bucket prefix"
  type        = string
  default     = "spotrl"
}

variable "spotrl_namespace" {
  description = "Namespace the Helm chart will be installed into (`helm install -n ...`)"
  type        = string
  default     = "spotrl"
}

variable "helm_release_name" {
  description = "Release name the Helm chart will be installed as (`helm install <name>`): its service accounts get the bucket"
  type        = string
  default     = "spotrl"
}

variable "endpoint_public_access_cidrs" {
  description = "CIDR blocks that may reach the cluster's API endpoint: the machine running terraform, helm and kubectl (e.g. [\"203.0.113.7/32\"])"
  type        = list(string)
}

variable "create_backends" {
  description = "Whether to create the production backends (RDS PostgreSQL, MSK with SASL/SCRAM, ElastiCache Redis) and the Kubernetes Secret of their URLs for the chart"
  type        = bool
  default     = false
}

variable "enable_kube_prometheus_stack" {
  description = "Whether to install kube-prometheus-stack (Prometheus, Grafana with the chart's dashboards in their folder)"
  type        = bool
  default     = false
}

variable "training_spot_enabled" {
  description = "Whether to add the spot training pool, for runs whose `training.capacity` is `spot` or `auto`"
  type        = bool
  default     = false
}

variable "bucket_force_destroy" {
  description = "Whether `terraform destroy` deletes the checkpoint bucket with its objects (apply it as true before destroying)"
  type        = bool
  default     = false
}

variable "ecr_force_delete" {
  description = "Whether `terraform destroy` deletes the image repositories with their images (apply it as true before destroying)"
  type        = bool
  default     = false
}

variable "backends_deletion_protection" {
  description = "Whether the state store refuses deletion and leaves a final snapshot (apply it as false before destroying)"
  type        = bool
  default     = true
}

variable "tags" {
  description = "Tags added to every resource"
  type        = map(string)
  default = {
    Project = "spotrl"
  }
}
