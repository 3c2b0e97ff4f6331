################################################################################
# Container images: one ECR repository per image of docker/ (`make push REGISTRY=...`)
################################################################################

locals {
  # The images `make images` builds (docker/<name>.Dockerfile -> spotrl-<name>), by the chart's
  # key under `image` (deploy/helm/spotrl/values.yaml: image.control, image.rollout, image.training).
  # The reward service runs the rollout image.
  images = {
    control  = "spotrl-control"
    rollout  = "spotrl-rollout"
    training = "spotrl-training"
  }

  # Repositories are `<name>/<image>`, so that `image.registry` is `<account>.dkr.ecr.<region>.amazonaws.com/<name>`
  # and the chart's default repository names hold.
  image_repository_prefix = var.name

  # The chart's image.registry: the repositories' common part, `<registry host>/<name>`.
  image_registry = trimsuffix(aws_ecr_repository.this["control"].repository_url, "/${local.images.control}")
}

resource "aws_ecr_repository" "this" {
  for_each = local.images

  name = "${local.image_repository_prefix}/${each.value}"

  # A tag names one image for good: a pod relaunched on a spot node an hour later runs what the
  # first one ran. `make push` also records each image's digest for the chart.
  image_tag_mutability = "IMMUTABLE"

  # AWS-managed KMS key (aws/ecr): the nodes' roles pull without a key policy of this module's.
  encryption_configuration {
    encryption_type = "KMS"
  }

  image_scanning_configuration {
    scan_on_push = true
  }

  # With true, `terraform destroy` deletes the repositories with their images in them.
  force_delete = var.ecr_force_delete

  tags = local.tags
}

# Untagged images (layers of a build pushed again under another tag, manifests left behind) go
# after a while; tagged ones stay until removed by hand: a run may still name them.
resource "aws_ecr_lifecycle_policy" "this" {
  for_each = aws_ecr_repository.this

  repository = each.value.name
  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Expire untagged images"
      selection = {
        tagStatus   = "untagged"
        countType   = "sinceImagePushed"
        countUnit   = "days"
        countNumber = var.ecr_untagged_expiration_days
      }
      action = { type = "expire" }
    }]
  })
}
