################################################################################
# Object store: policy versions and trainer state (runs/<run>/policy/v<N>/, runs/<run>/trainer/v<N>/)
################################################################################

locals {
  bucket_name = coalesce(var.bucket_name, "${var.name}-${data.aws_caller_identity.current.account_id}-${data.aws_region.current.region}")
}

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles the storage of multi-GB checkpoints; a lost run is retrained from its last published version, and versioning already guards against overwrites and deletes.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events: workers learn of a new policy version from the state store's pointer, not from S3 notifications.
  #checkov:skip=CKV_AWS_18:Access logs need a second bucket that this module does not own; enable them with aws_s3_bucket_logging towards your organisation's log bucket (CloudTrail data events are the usual alternative).
  bucket        = local.bucket_name
  force_destroy = var.bucket_force_destroy

  tags = local.tags
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.bucket.arn
    }
    # One KMS request per bucket key instead of one per object: checkpoints are many shards.
    bucket_key_enabled = true
  }
}

resource "aws_kms_key" "bucket" {
  description             = "spotrl ${var.name}: encrypts the checkpoint bucket ${local.bucket_name}"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.bucket_key.json

  tags = local.tags
}

resource "aws_kms_alias" "bucket" {
  name          = "alias/${var.name}-checkpoints"
  target_key_id = aws_kms_key.bucket.key_id
}

# The account administers the key; S3 uses it on behalf of the principals the bucket lets in.
data "aws_iam_policy_document" "bucket_key" {
  #checkov:skip=CKV_AWS_109:This is a KMS key policy: "*" is the key itself, and the statement is AWS's default key policy that delegates the key's use to the account's IAM policies.
  #checkov:skip=CKV_AWS_111:This is a KMS key policy: "*" is the key itself, and the statement is AWS's default key policy that delegates the key's use to the account's IAM policies.
  #checkov:skip=CKV_AWS_356:This is a KMS key policy: "*" is the key itself, and the statement is AWS's default key policy that delegates the key's use to the account's IAM policies.
  statement {
    sid       = "AccountAdministersKey"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
}

# Old checkpoints: versions no longer published move to cheaper storage, then expire if asked to.
# S3 lifecycle prefixes cannot match runs/*/trainer/, so policy and trainer state share the rules.
resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "old-checkpoints"
    status = "Enabled"

    filter {
      prefix = "runs/"
    }

    transition {
      days          = var.checkpoint_transition_days
      storage_class = "STANDARD_IA"
    }

    dynamic "expiration" {
      for_each = var.checkpoint_expiration_days == null ? [] : [var.checkpoint_expiration_days]
      content {
        days = expiration.value
      }
    }

    # Overwritten or deleted checkpoint objects stay recoverable for a while, then go.
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }
  }

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    # A training job killed mid-upload leaves parts behind that would be billed forever.
    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_upload_days
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  depends_on = [aws_s3_bucket_public_access_block.this]
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}
