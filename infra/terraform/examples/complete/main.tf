provider "aws" {
  region = var.region
}

# Both Kubernetes-facing providers authenticate with the AWS CLI's token for the new cluster.
provider "helm" {
  kubernetes = {
    host                   = module.spotrl.cluster_endpoint
    cluster_ca_certificate = base64decode(module.spotrl.cluster_certificate_authority_data)

    exec = {
      api_version = "client.authentication.k8s.io/v1beta1"
      command     = "aws"
      args        = ["eks", "get-token", "--cluster-name", module.spotrl.cluster_name, "--region", var.region]
    }
  }
}

provider "kubectl" {
  host                   = module.spotrl.cluster_endpoint
  cluster_ca_certificate = base64decode(module.spotrl.cluster_certificate_authority_data)
  load_config_file       = false

  exec {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", module.spotrl.cluster_name, "--region", var.region]
  }
}

locals {
  vpc_cidr = "10.0.0.0/16"
}

module "spotrl" {
  source = "../.."

  name       = var.name
  vpc_id     = module.vpc.vpc_id
  subnet_ids = module.vpc.private_subnets

  control_plane_subnet_ids     = module.vpc.intra_subnets
  endpoint_public_access       = true
  endpoint_public_access_cidrs = var.endpoint_public_access_cidrs

  spotrl_namespace  = var.spotrl_namespace
  helm_release_name = var.helm_release_name

  create_backends              = var.create_backends
  enable_kube_prometheus_stack = var.enable_kube_prometheus_stack
  training_spot_enabled        = var.training_spot_enabled

  # What `terraform destroy` may delete with data in it (README.md, "Install on Kubernetes", teardown).
  bucket_force_destroy         = var.bucket_force_destroy
  ecr_force_delete             = var.ecr_force_delete
  backends_deletion_protection = var.backends_deletion_protection

  tags = var.tags
}

module "vpc" {
  #checkov:skip=CKV_TF_1:A Terraform Registry module, pinned to one release by `version`; a commit-hash source would bypass the registry and its release checksums.
  source  = "terraform-aws-modules/vpc/aws"
  version = "6.6.0"

  name = var.name
  cidr = local.vpc_cidr

  azs             = var.availability_zones
  private_subnets = [for k, v in var.availability_zones : cidrsubnet(local.vpc_cidr, 4, k)]
  public_subnets  = [for k, v in var.availability_zones : cidrsubnet(local.vpc_cidr, 8, k + 48)]
  intra_subnets   = [for k, v in var.availability_zones : cidrsubnet(local.vpc_cidr, 8, k + 52)]

  enable_nat_gateway = true
  single_nat_gateway = true

  public_subnet_tags = {
    "kubernetes.io/role/elb" = 1
  }

  private_subnet_tags = {
    "kubernetes.io/role/internal-elb" = 1
  }

  tags = var.tags
}
