################################################################################
# Cluster
################################################################################

variable "name" {
  description = "Name of the EKS cluster, and the prefix of every resource this module names"
  type        = string
  default     = "spotrl"
}

variable "kubernetes_version" {
  description = "Kubernetes `<major>.<minor>` version of the EKS cluster"
  type        = string
  default     = "1.33"
}

variable "vpc_id" {
  description = "ID of the VPC the cluster and its nodes run in"
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets of the nodes (system node group and Karpenter's GPU nodes); spread them over several availability zones so spot capacity has more pools to come from"
  type        = list(string)
}

variable "control_plane_subnet_ids" {
  description = "Subnets of the control plane's network interfaces; empty means `subnet_ids`"
  type        = list(string)
  default     = []
}

variable "endpoint_public_access" {
  description = "Whether the cluster's API endpoint is reachable from the internet (needed to run `terraform apply`, `helm install` and `kubectl` from outside the VPC)"
  type        = bool
  default     = false
}

variable "endpoint_public_access_cidrs" {
  description = "CIDR blocks allowed to reach the public API endpoint when `endpoint_public_access` is true; required then, since EKS would otherwise open the endpoint to 0.0.0.0/0"
  type        = list(string)
  default     = []

  validation {
    condition     = !var.endpoint_public_access || length(var.endpoint_public_access_cidrs) > 0
    error_message = "endpoint_public_access needs endpoint_public_access_cidrs: EKS opens an endpoint without them to the whole internet."
  }
}

variable "tags" {
  description = "Tags added to every AWS resource this module creates (and to Karpenter's GPU nodes)"
  type        = map(string)
  default     = {}
}

################################################################################
# System node group (on-demand CPU: Karpenter, CoreDNS, spotrl API and scheduler)
################################################################################

variable "system_instance_types" {
  description = "Instance types of the system managed node group (on-demand CPU)"
  type        = list(string)
  default     = ["m7i.large", "m6i.large"]
}

variable "system_min_size" {
  description = "Minimum number of system nodes; two keep the API and Karpenter up through a node replacement"
  type        = number
  default     = 2
}

variable "system_max_size" {
  description = "Maximum number of system nodes"
  type        = number
  default     = 4
}

variable "system_desired_size" {
  description = "Number of system nodes at creation (later changes are the node group's own)"
  type        = number
  default     = 2
}

################################################################################
# GPU node pools (Karpenter)
################################################################################

variable "karpenter_chart_version" {
  description = "Version of Karpenter's Helm chart (oci://public.ecr.aws/karpenter/karpenter); the NodePools use the karpenter.sh/v1 API, Karpenter 1.0 or later"
  type        = string
  default     = "1.6.0"
}

variable "nvidia_device_plugin_chart_version" {
  description = "Version of NVIDIA's device plugin Helm chart, which exposes `nvidia.com/gpu` on the GPU nodes"
  type        = string
  default     = "0.18.0"
}

variable "gpu_ami_alias" {
  description = "AMI alias of the GPU nodes' EC2NodeClass (`al2023@latest`, or a pinned release such as `al2023@v20251001` for reproducible nodes)"
  type        = string
  default     = "al2023@latest"
}

variable "gpu_node_volume_size_gib" {
  description = "Root volume of each GPU node in GiB: CUDA images and the model cache live there"
  type        = number
  default     = 200
}

variable "rollout_instance_families" {
  description = "EC2 instance families of the spot rollout pool: g5 (A10G) and g6 (L4)"
  type        = list(string)
  default     = ["g5", "g6"]
}

variable "rollout_gpu_limit" {
  description = "Most GPUs the rollout pool may hold at once"
  type        = number
  default     = 32
}

variable "rollout_consolidate_after" {
  description = "How long a rollout node stays empty or underutilized before Karpenter removes or repacks it"
  type        = string
  default     = "2m"
}

variable "training_instance_families" {
  description = "EC2 instance families of the on-demand training pool: p4d (A100) and p5 (H100)"
  type        = list(string)
  default     = ["p4d", "p5"]
}

variable "training_gpu_limit" {
  description = "Most GPUs the training pool may hold at once (p4d.24xlarge and p5.48xlarge have 8 each)"
  type        = number
  default     = 16
}

variable "training_spot_enabled" {
  description = "Whether to add the spot training pool (Karpenter NodePool `spotrl-training-spot`): the training pool's instance families, label and taint on spot capacity, for the training jobs the scheduler puts on spot (a run's `training.capacity`); at zero between jobs"
  type        = bool
  default     = false
}

variable "training_spot_gpu_limit" {
  description = "Most GPUs the spot training pool may hold at once (with training_spot_enabled)"
  type        = number
  default     = 16
}

variable "training_consolidate_after" {
  description = "How long a training node (on-demand or spot) stays empty before it is given back; the pools are at zero between iterations"
  type        = string
  default     = "30s"
}

variable "reward_instance_families" {
  description = "EC2 instance families of the reward service's pool: g4dn (T4)"
  type        = list(string)
  default     = ["g4dn"]
}

variable "reward_capacity_types" {
  description = "Capacity types of the reward pool (`on-demand`, `spot`): the reward service is long-lived and every rollout worker waits on it, hence on-demand by default"
  type        = list(string)
  default     = ["on-demand"]

  validation {
    condition     = length(var.reward_capacity_types) > 0 && alltrue([for c in var.reward_capacity_types : contains(["on-demand", "spot"], c)])
    error_message = "reward_capacity_types holds \"on-demand\" and/or \"spot\"."
  }
}

variable "reward_gpu_limit" {
  description = "Most GPUs the reward pool may hold at once"
  type        = number
  default     = 4
}

variable "reward_consolidate_after" {
  description = "How long a reward node stays empty before it is given back"
  type        = string
  default     = "5m"
}

################################################################################
# Object store and identity
################################################################################

variable "bucket_name" {
  description = "Name of the checkpoint bucket; null means `<name>-<account id>-<region>`"
  type        = string
  default     = null
}

variable "bucket_force_destroy" {
  description = "Whether `terraform destroy` deletes the bucket with its checkpoints still in it"
  type        = bool
  default     = false
}

variable "checkpoint_transition_days" {
  description = "Days after which objects under `runs/` (policy versions, trainer state) move to STANDARD_IA; rollout workers only read the newest versions"
  type        = number
  default     = 30
}

variable "checkpoint_expiration_days" {
  description = "Days after which objects under `runs/` expire (become noncurrent versions); null keeps them"
  type        = number
  default     = null
}

variable "noncurrent_version_expiration_days" {
  description = "Days an overwritten or deleted object's previous version is kept before it is removed for good"
  type        = number
  default     = 30
}

variable "abort_incomplete_multipart_upload_days" {
  description = "Days after which the parts of an unfinished multipart upload (a training job killed mid-publish) are deleted"
  type        = number
  default     = 7
}

variable "spotrl_namespace" {
  description = "Kubernetes namespace the Helm chart is installed into (`helm install -n ...`)"
  type        = string
  default     = "spotrl"
}

variable "helm_release_name" {
  description = "Name of the chart's Helm release (`helm install <name>`): its service accounts `<fullname>-api`, `-scheduler` and `-workload` get the bucket (fullname: the name, suffixed `-spotrl` unless it contains \"spotrl\")"
  type        = string
  default     = "spotrl"

  validation {
    condition     = length(var.helm_release_name) <= 53 && can(regex("^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", var.helm_release_name))
    error_message = "helm_release_name is a Helm release name: lowercase letters, digits and '-', at most 53 characters."
  }
}

################################################################################
# Container images (ECR)
################################################################################

variable "ecr_force_delete" {
  description = "Whether `terraform destroy` deletes the image repositories with their images in them (apply it as true before destroying)"
  type        = bool
  default     = false
}

variable "ecr_untagged_expiration_days" {
  description = "Days after which an untagged image (one whose tag moved on or never had one) is removed from its repository"
  type        = number
  default     = 14
}

################################################################################
# Production backends (opt-in): RDS PostgreSQL, MSK, ElastiCache Redis
################################################################################

variable "create_backends" {
  description = "Whether to create the production backends (RDS PostgreSQL state store, MSK queue with SASL/SCRAM, ElastiCache Redis reward cache) and the Kubernetes Secret of their URLs that helm_values names as backends.existingSecret; false leaves the backends to you (or to the chart's trial ones)"
  type        = bool
  default     = false
}

variable "backend_subnet_ids" {
  description = "Private subnets of the backends; empty means `subnet_ids`. MSK takes the first three (one broker zone each), so list subnets of distinct availability zones"
  type        = list(string)
  default     = []
}

variable "backends_deletion_protection" {
  description = "Whether the state store refuses deletion and leaves a final snapshot when destroyed; apply it as false before `terraform destroy` to remove the database for good"
  type        = bool
  default     = true
}

variable "backends_log_retention_days" {
  description = "Days the MSK broker logs are kept in CloudWatch Logs"
  type        = number
  default     = 365
}

variable "postgres_major_version" {
  description = "Major version of RDS PostgreSQL (the parameter group's family is `postgres<version>`)"
  type        = string
  default     = "17"
}

variable "postgres_instance_class" {
  description = "RDS instance class of the state store: the scheduler's ticks and the pods' reports are small transactions"
  type        = string
  default     = "db.t4g.medium"
}

variable "postgres_storage_gib" {
  description = "Allocated storage of the state store in GiB"
  type        = number
  default     = 20
}

variable "postgres_max_storage_gib" {
  description = "Ceiling of the state store's storage autoscaling in GiB"
  type        = number
  default     = 100
}

variable "postgres_multi_az" {
  description = "Whether the state store has a standby in a second zone (about twice the instance's price); the scheduler and the API stop while it is down"
  type        = bool
  default     = true
}

variable "postgres_backup_retention_days" {
  description = "Days of the state store's automated backups"
  type        = number
  default     = 7
}

variable "kafka_version" {
  description = "Apache Kafka version of the MSK cluster"
  type        = string
  default     = "3.8.x"
}

variable "kafka_instance_type" {
  description = "Instance type of each MSK broker"
  type        = string
  default     = "kafka.m7g.large"
}

variable "kafka_brokers_per_zone" {
  description = "MSK brokers in each of the (up to three) backend zones"
  type        = number
  default     = 1
}

variable "kafka_volume_size_gib" {
  description = "EBS volume of each MSK broker in GiB; topics hold a run's samples until it ends, then are deleted after the chart's settings.queueRetentionS"
  type        = number
  default     = 100
}

variable "redis_engine_version" {
  description = "Redis engine version of the ElastiCache reward cache"
  type        = string
  default     = "7.1"
}

variable "redis_node_type" {
  description = "ElastiCache node type of the reward cache"
  type        = string
  default     = "cache.t4g.medium"
}

variable "redis_num_cache_clusters" {
  description = "Nodes of the reward cache: 1, or more for a failover replica in another zone (a lost cache costs misses, not runs)"
  type        = number
  default     = 1
}

################################################################################
# Monitoring
################################################################################

variable "enable_dcgm_exporter" {
  description = "Whether to install NVIDIA's dcgm-exporter on the GPU nodes: per-GPU utilization labelled with the pod using it, which the chart's Utilization dashboard joins to spotrl's pods"
  type        = bool
  default     = true
}

variable "dcgm_exporter_chart_version" {
  description = "Version of NVIDIA's dcgm-exporter Helm chart (https://nvidia.github.io/dcgm-exporter/helm-charts)"
  type        = string
  default     = "4.8.2"
}

variable "dcgm_exporter_service_monitor" {
  description = "Whether dcgm-exporter gets a ServiceMonitor without kube-prometheus-stack, for a Prometheus Operator of your own (its CRDs must be in the cluster); with kube-prometheus-stack it always gets one"
  type        = bool
  default     = false
}

variable "enable_kube_prometheus_stack" {
  description = "Whether to install kube-prometheus-stack (Prometheus Operator, Prometheus, Grafana) set up for spotrl: every ServiceMonitor scraped, the chart's dashboards loaded into their Grafana folder; helm_values then turns on the chart's ServiceMonitor"
  type        = bool
  default     = false
}

variable "kube_prometheus_stack_chart_version" {
  description = "Version of the kube-prometheus-stack Helm chart (https://prometheus-community.github.io/helm-charts)"
  type        = string
  default     = "67.8.0"
}

variable "monitoring_namespace" {
  description = "Namespace of dcgm-exporter and kube-prometheus-stack"
  type        = string
  default     = "monitoring"
}

variable "prometheus_retention" {
  description = "How long Prometheus keeps its series (kube-prometheus-stack), on the pod's own volume"
  type        = string
  default     = "15d"
}
