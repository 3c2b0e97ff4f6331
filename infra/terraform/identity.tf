################################################################################
# EKS Pod Identity: the spotrl service account reads and writes the bucket
################################################################################

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
  description        = "spotrl ${var.name}: pods of service account ${var.spotrl_namespace}/${var.spotrl_service_account} (API, scheduler, rollout workers, training jobs, reward service)"
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

resource "aws_eks_pod_identity_association" "spotrl" {
  cluster_name    = module.eks.cluster_name
  namespace       = var.spotrl_namespace
  service_account = var.spotrl_service_account
  role_arn        = aws_iam_role.spotrl.arn

  tags = local.tags
}
