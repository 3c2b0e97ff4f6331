################################################################################
# EKS Pod Identity: the Helm chart's service accounts read and write the bucket
################################################################################

locals {
  # The chart's object names (deploy/helm/spotrl/templates/_helpers.tpl, "spotrl.fullname"): the
  # release name, with "-spotrl" appended unless it already contains "spotrl", cut to 52
  # characters. helm_values pins it as fullnameOverride, so the names hold whatever the release.
  helm_fullname = trimsuffix(substr(strcontains(var.helm_release_name, "spotrl") ? var.helm_release_name : "${var.helm_release_name}-spotrl", 0, 52), "-")

  # All three of the chart's service accounts use the bucket: the API stores prompt sets and reads
  # the pod logs kept there, the scheduler reads job results, keeps pod logs and rotates policy
  # versions, and the launched pods (`-workload`: rollout workers, training jobs, reward services)
  # read and publish policy versions and trainer state.
  spotrl_service_accounts = { for component in ["api", "scheduler", "workload"] : component => "${local.helm_fullname}-${component}" }
}

data "aws_iam_policy_document" "spotrl_assume" {
  statement {
    sid     = "EksPodIdentity"
    actions = ["sts:AssumeRole", "sts:TagSession"]

    principals {
      type        = "Service"
      identifiers = ["pods.eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "spotrl" {
  name               = "${var.name}-spotrl"
  description        = "spotrl ${var.name}: pods of the Helm release ${var.spotrl_namespace}/${var.helm_release_name} (API, scheduler, rollout workers, training jobs, reward service)"
  assume_role_policy = data.aws_iam_policy_document.spotrl_assume.json

  tags = local.tags
}

data "aws_iam_policy_document" "spotrl_objects" {
  statement {
    sid       = "ListBucket"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [aws_s3_bucket.this.arn]
  }

  # Read, publish and delete policy versions and trainer state; multipart uploads of large shards.
  statement {
    sid = "ReadWriteObjects"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${aws_s3_bucket.this.arn}/*"]
  }

  statement {
    sid       = "UseBucketKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.bucket.arn]
  }
}

resource "aws_iam_role_policy" "spotrl_objects" {
  name   = "objects"
  role   = aws_iam_role.spotrl.id
  policy = data.aws_iam_policy_document.spotrl_objects.json
}

# One association per service account (an association names exactly one); none needs an annotation.
resource "aws_eks_pod_identity_association" "spotrl" {
  for_each = local.spotrl_service_accounts

  cluster_name    = module.eks.cluster_name
  namespace       = var.spotrl_namespace
  service_account = each.value
  role_arn        = aws_iam_role.spotrl.arn

  tags = local.tags
}

# The chart's namespace, which the associations above name; the backends' Secret (backends.tf) is
# created in it before the chart is installed. `helm install --create-namespace` leaves it as it is.
# `wait`: on destroy, Terraform waits until the namespace and everything left in it are gone.
resource "kubectl_manifest" "namespace" {
  yaml_body = yamlencode({
    apiVersion = "v1"
    kind       = "Namespace"
    metadata = {
      name   = var.spotrl_namespace
      labels = { "app.kubernetes.io/part-of" = "spotrl" }
    }
  })
  wait = true

  depends_on = [module.eks]
}
