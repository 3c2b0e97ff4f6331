terraform {
  required_version = ">= 1.9" # validations that refer to other variables

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 6.28"
    }
    helm = {
      source  = "hashicorp/helm"
      version = ">= 3.0"
    }
    # The backends' passwords and Grafana's admin password.
    random = {
      source  = "hashicorp/random"
      version = ">= 3.6"
    }
    # Applies Karpenter's NodePools and EC2NodeClass: unlike kubernetes_manifest, it does not need
    # their CRDs to exist at plan time, so one `terraform apply` creates the cluster and the pools.
    kubectl = {
      source  = "alekc/kubectl"
      version = ">= 2.1"
    }
  }
}
