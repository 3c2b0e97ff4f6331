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

variable "training_consolidate_after" {
  description = "How long a training node stays empty before it is given back; the pool is at zero between iterations"
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
