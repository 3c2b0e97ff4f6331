################################################################################
# Production backends (opt-in: create_backends): RDS PostgreSQL (state store), MSK (queue,
# SASL/SCRAM over TLS), ElastiCache Redis (reward cache, TLS and an auth token). Each is reachable
# from the cluster's nodes only, on its own port. Their URLs and credentials go into a Kubernetes
# Secret in the chart's namespace, which `helm_values` names as `backends.existingSecret`; the
# chart hands it to every spotrl pod (envFrom), launched ones included.
#
# Terraform generates the passwords, so its state holds them: keep the state in an encrypted
# backend (S3 with SSE-KMS) that only the operators can read.
################################################################################

locals {
  backends_count = var.create_backends ? 1 : 0

  backend_subnet_ids = length(var.backend_subnet_ids) > 0 ? var.backend_subnet_ids : var.subnet_ids
  # MSK places brokers in two or three client subnets, each in its own availability zone.
  kafka_subnet_ids = slice(local.backend_subnet_ids, 0, min(3, length(local.backend_subnet_ids)))

  # Each backend's security group admits the nodes' security group on this port and nothing else.
  # 9096 is MSK's SASL/SCRAM listener (TLS).
  backend_ports = {
    postgres = 5432
    kafka    = 9096
    redis    = 6379
  }

  backends_secret_name = "${local.helm_fullname}-aws-backends"
  postgres_database    = "spotrl"
  postgres_username    = "spotrl"
  kafka_username       = "spotrl"

  # The Secret's keys: the environment every spotrl process reads (services/core/config.py). The queue
  # URL names the protocol and mechanism (services/ports/queue/kafka_settings.py); the SCRAM user and
  # password come as SPOTRL_KAFKA_SASL_PLAIN_*, kafka-python's names for SCRAM's credentials too.
  # sslmode=require: TLS to RDS (the parameter group refuses plain connections) without the RDS
  # CA bundle in the images. Passwords are alphanumeric, so they need no escaping in a URL.
  backends_env = var.create_backends ? {
    SPOTRL_STATE_URL                 = "postgresql+psycopg://${local.postgres_username}:${random_password.postgres[0].result}@${aws_db_instance.this[0].address}:${aws_db_instance.this[0].port}/${local.postgres_database}?sslmode=require"
    SPOTRL_QUEUE_URL                 = "kafka://${aws_msk_cluster.this[0].bootstrap_brokers_sasl_scram}?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512"
    SPOTRL_KAFKA_SASL_PLAIN_USERNAME = local.kafka_username
    SPOTRL_KAFKA_SASL_PLAIN_PASSWORD = random_password.kafka[0].result
    SPOTRL_REWARD_CACHE_URL          = "rediss://:${random_password.redis[0].result}@${aws_elasticache_replication_group.this[0].primary_endpoint_address}:${aws_elasticache_replication_group.this[0].port}/0"
  } : {}
}

################################################################################
# Network: one security group per backend, open to the nodes only
################################################################################

resource "aws_security_group" "backends" {
  #checkov:skip=CKV2_AWS_5:Each group is attached by its key: the DB instance (postgres), the MSK brokers (kafka) and the replication group (redis); checkov's graph does not follow for_each keys. tests/deploy/test_terraform.py checks each attachment.
  for_each = { for name, port in local.backend_ports : name => port if var.create_backends }

  name_prefix = "${var.name}-spotrl-${each.key}-"
  description = "spotrl ${var.name}: ${each.key}, reachable from the cluster's nodes on port ${each.value} only"
  vpc_id      = var.vpc_id

  # No egress rule: the backends answer connections, they open none.

  tags = merge(local.tags, { Name = "${var.name}-spotrl-${each.key}" })

  lifecycle {
    create_before_destroy = true
  }
}

# Pods use their node's security group (VPC CNI without security groups for pods): the system
# node group and Karpenter's GPU nodes (the EC2NodeClass) both carry the module's node group.
resource "aws_vpc_security_group_ingress_rule" "backends" {
  for_each = aws_security_group.backends

  security_group_id            = each.value.id
  description                  = "spotrl pods (the cluster's nodes) to ${each.key}"
  referenced_security_group_id = module.eks.node_security_group_id
  ip_protocol                  = "tcp"
  from_port                    = local.backend_ports[each.key]
  to_port                      = local.backend_ports[each.key]

  tags = local.tags
}

################################################################################
# Encryption key of all three (storage, MSK's SCRAM secret, MSK's broker logs)
################################################################################

resource "aws_kms_key" "backends" {
  count = local.backends_count

  description             = "spotrl ${var.name}: encrypts the state store, the queue, the reward cache, the queue's SCRAM secret and its broker logs"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.backends_key[0].json

  tags = local.tags
}

resource "aws_kms_alias" "backends" {
  count = local.backends_count

  name          = "alias/${var.name}-backends"
  target_key_id = aws_kms_key.backends[0].key_id
}

data "aws_iam_policy_document" "backends_key" {
  #checkov:skip=CKV_AWS_109:This is a KMS key policy: "*" is the key itself; the first statement is AWS's default key policy that delegates the key's use to the account's IAM policies, the second lets CloudWatch Logs encrypt the MSK broker log group only.
  #checkov:skip=CKV_AWS_111:This is a KMS key policy: "*" is the key itself; the first statement is AWS's default key policy that delegates the key's use to the account's IAM policies, the second lets CloudWatch Logs encrypt the MSK broker log group only.
  #checkov:skip=CKV_AWS_356:This is a KMS key policy: "*" is the key itself; the first statement is AWS's default key policy that delegates the key's use to the account's IAM policies, the second lets CloudWatch Logs encrypt the MSK broker log group only.
  count = local.backends_count

  statement {
    sid       = "AccountAdministersKey"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }

  statement {
    sid       = "CloudWatchLogsEncryptsBrokerLogs"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]

    principals {
      type        = "Service"
      identifiers = ["logs.${data.aws_region.current.region}.amazonaws.com"]
    }

    condition {
      test     = "ArnEquals"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${data.aws_partition.current.partition}:logs:${data.aws_region.current.region}:${data.aws_caller_identity.current.account_id}:log-group:${local.kafka_log_group_name}"]
    }
  }
}

################################################################################
# State store: RDS PostgreSQL
################################################################################

resource "random_password" "postgres" {
  count = local.backends_count

  length  = 32
  special = false
}

resource "aws_db_subnet_group" "this" {
  count = local.backends_count

  name_prefix = "${var.name}-spotrl-"
  description = "spotrl ${var.name}: the state store's subnets"
  subnet_ids  = local.backend_subnet_ids

  tags = local.tags
}

resource "aws_db_parameter_group" "this" {
  count = local.backends_count

  name_prefix = "${var.name}-spotrl-"
  description = "spotrl ${var.name}: TLS only, slow statements and DDL logged"
  family      = "postgres${var.postgres_major_version}"

  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }

  parameter {
    name  = "log_statement"
    value = "ddl"
  }

  # The scheduler's tick and the pods' reports are short statements; anything over a second is news.
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }

  tags = local.tags

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_db_instance" "this" {
  #checkov:skip=CKV_AWS_118:Enhanced monitoring needs an IAM role of its own for OS-level figures; Performance Insights (on) and RDS's standard CloudWatch metrics cover the state store's load.
  count = local.backends_count

  identifier     = "${var.name}-spotrl"
  engine         = "postgres"
  engine_version = var.postgres_major_version
  instance_class = var.postgres_instance_class

  allocated_storage     = var.postgres_storage_gib
  max_allocated_storage = var.postgres_max_storage_gib
  storage_type          = "gp3"
  storage_encrypted     = true
  kms_key_id            = aws_kms_key.backends[0].arn

  db_name  = local.postgres_database
  username = local.postgres_username
  password = random_password.postgres[0].result
  port     = local.backend_ports.postgres

  db_subnet_group_name   = aws_db_subnet_group.this[0].name
  vpc_security_group_ids = [aws_security_group.backends["postgres"].id]
  publicly_accessible    = false
  parameter_group_name   = aws_db_parameter_group.this[0].name

  multi_az                            = var.postgres_multi_az
  backup_retention_period             = var.postgres_backup_retention_days
  copy_tags_to_snapshot               = true
  deletion_protection                 = var.backends_deletion_protection
  skip_final_snapshot                 = !var.backends_deletion_protection
  final_snapshot_identifier           = "${var.name}-spotrl-final"
  auto_minor_version_upgrade          = true
  iam_database_authentication_enabled = true
  enabled_cloudwatch_logs_exports     = ["postgresql", "upgrade"]

  performance_insights_enabled          = true
  performance_insights_kms_key_id       = aws_kms_key.backends[0].arn
  performance_insights_retention_period = 7

  tags = local.tags
}

################################################################################
# Queue: MSK, SASL/SCRAM-SHA-512 over TLS, the user in Secrets Manager
################################################################################

locals {
  kafka_log_group_name = "/aws/msk/${var.name}-spotrl"
  # Three brokers (three zones) keep acks=all writes going through the loss of one.
  kafka_replication_factor = min(3, length(local.kafka_subnet_ids) * var.kafka_brokers_per_zone)
}

resource "random_password" "kafka" {
  count = local.backends_count

  length  = 32
  special = false
}

# MSK reads SCRAM users from Secrets Manager secrets named AmazonMSK_* and encrypted with a
# customer managed key. A name prefix, so that a secret pending deletion never blocks a new one.
resource "aws_secretsmanager_secret" "kafka" {
  #checkov:skip=CKV2_AWS_57:Rotating the SCRAM password would need a rotation Lambda and would cut off every pod holding the old one until the Kubernetes Secret is rewritten; rotate by tainting random_password.kafka and applying again.
  count = local.backends_count

  name_prefix             = "AmazonMSK_${var.name}-spotrl-"
  description             = "spotrl ${var.name}: the SASL/SCRAM user of the MSK cluster ${var.name}-spotrl"
  kms_key_id              = aws_kms_key.backends[0].arn
  recovery_window_in_days = 7

  tags = local.tags
}

resource "aws_secretsmanager_secret_version" "kafka" {
  count = local.backends_count

  secret_id = aws_secretsmanager_secret.kafka[0].id
  secret_string = jsonencode({
    username = local.kafka_username
    password = random_password.kafka[0].result
  })
}

resource "aws_cloudwatch_log_group" "kafka" {
  count = local.backends_count

  name              = local.kafka_log_group_name
  retention_in_days = var.backends_log_retention_days
  kms_key_id        = aws_kms_key.backends[0].arn

  tags = local.tags
}

resource "aws_msk_configuration" "this" {
  count = local.backends_count

  name           = "${var.name}-spotrl"
  description    = "spotrl ${var.name}: topics created and deleted by spotrl, replicated across zones"
  kafka_versions = [var.kafka_version]

  # spotrl creates each run's topics itself and deletes them after the run. SCRAM authenticates the
  # one user; no ACLs are kept, so an authenticated client may use every topic.
  server_properties = <<-EOT
    auto.create.topics.enable=false
    delete.topic.enable=true
    allow.everyone.if.no.acl.found=true
    default.replication.factor=${local.kafka_replication_factor}
    min.insync.replicas=${max(1, local.kafka_replication_factor - 1)}
  EOT
}

resource "aws_msk_cluster" "this" {
  count = local.backends_count

  cluster_name           = "${var.name}-spotrl"
  kafka_version          = var.kafka_version
  number_of_broker_nodes = length(local.kafka_subnet_ids) * var.kafka_brokers_per_zone

  broker_node_group_info {
    instance_type   = var.kafka_instance_type
    client_subnets  = local.kafka_subnet_ids
    security_groups = [aws_security_group.backends["kafka"].id]

    storage_info {
      ebs_storage_info {
        volume_size = var.kafka_volume_size_gib
      }
    }

    connectivity_info {
      public_access {
        type = "DISABLED"
      }
    }
  }

  # SASL/SCRAM only: no unauthenticated, TLS-certificate or IAM access.
  client_authentication {
    unauthenticated = false

    sasl {
      scram = true
    }
  }

  encryption_info {
    encryption_at_rest_kms_key_arn = aws_kms_key.backends[0].arn

    encryption_in_transit {
      client_broker = "TLS"
      in_cluster    = true
    }
  }

  configuration_info {
    arn      = aws_msk_configuration.this[0].arn
    revision = aws_msk_configuration.this[0].latest_revision
  }

  logging_info {
    broker_logs {
      cloudwatch_logs {
        enabled   = true
        log_group = aws_cloudwatch_log_group.kafka[0].name
      }
    }
  }

  tags = local.tags
}

resource "aws_msk_scram_secret_association" "this" {
  count = local.backends_count

  cluster_arn     = aws_msk_cluster.this[0].arn
  secret_arn_list = [aws_secretsmanager_secret.kafka[0].arn]

  depends_on = [aws_secretsmanager_secret_version.kafka]
}

################################################################################
# Reward cache: ElastiCache Redis, TLS and an auth token
################################################################################

resource "random_password" "redis" {
  count = local.backends_count

  length  = 64
  special = false
}

resource "aws_elasticache_subnet_group" "this" {
  count = local.backends_count

  name        = "${var.name}-spotrl"
  description = "spotrl ${var.name}: the reward cache's subnets"
  subnet_ids  = local.backend_subnet_ids

  tags = local.tags
}

resource "aws_elasticache_replication_group" "this" {
  #checkov:skip=CKV2_AWS_50:One node by default: the reward cache holds only scores that can be computed again, so a failover replica buys little; set redis_num_cache_clusters above 1 for one (failover and Multi-AZ then follow).
  count = local.backends_count

  replication_group_id = "${var.name}-spotrl"
  description          = "spotrl ${var.name}: reward cache"
  engine               = "redis"
  engine_version       = var.redis_engine_version
  node_type            = var.redis_node_type
  port                 = local.backend_ports.redis

  # One node by default: losing it costs cache misses only. More than one adds a failover replica.
  num_cache_clusters         = var.redis_num_cache_clusters
  automatic_failover_enabled = var.redis_num_cache_clusters > 1
  multi_az_enabled           = var.redis_num_cache_clusters > 1

  subnet_group_name  = aws_elasticache_subnet_group.this[0].name
  security_group_ids = [aws_security_group.backends["redis"].id]

  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.backends[0].arn
  transit_encryption_enabled = true
  auth_token                 = random_password.redis[0].result

  # No snapshots: the cache holds only scores that can be computed again (a miss costs a reward
  # call, never a run).
  auto_minor_version_upgrade = true
  snapshot_retention_limit   = 0

  tags = local.tags
}

################################################################################
# The Kubernetes Secret the chart reads (backends.existingSecret)
################################################################################

resource "kubectl_manifest" "backends_secret" {
  count = local.backends_count

  yaml_body = yamlencode({
    apiVersion = "v1"
    kind       = "Secret"
    metadata = {
      name      = local.backends_secret_name
      namespace = var.spotrl_namespace
      labels    = { "app.kubernetes.io/part-of" = "spotrl", "app.kubernetes.io/managed-by" = "terraform" }
    }
    type = "Opaque"
    data = { for key, value in local.backends_env : key => base64encode(value) }
  })

  depends_on = [kubectl_manifest.namespace, aws_msk_scram_secret_association.this]
}
