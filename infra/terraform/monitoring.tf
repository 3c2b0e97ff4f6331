################################################################################
# Monitoring: dcgm-exporter on the GPU nodes (on by default), kube-prometheus-stack (opt-in)
#
# The chart's Utilization dashboard joins dcgm-exporter's DCGM_FI_DEV_GPU_UTIL{pod} to
# spotrl_pod_info{pod}. dcgm-exporter labels each GPU's series with the pod using it (`pod`,
# `namespace`, `container`); a scrape without honorLabels would rename that label to exported_pod
# and put the exporter's own pod name in its place, and the join would find nothing.
################################################################################

locals {
  # What Grafana's dashboard sidecar looks for, and what the chart's dashboard ConfigMaps carry
  # (deploy/helm/spotrl: dashboards.label, dashboards.labelValue, and the `grafana_folder`
  # annotation holding dashboards.folder). helm_values gives the chart the same.
  grafana_dashboards = {
    label      = "grafana_dashboard"
    labelValue = "1"
    folder     = "spotrl"
  }
  grafana_folder_annotation = "grafana_folder"

  # The ServiceMonitor of the chart's API needs an admin token (the token, not its hash) in this
  # Secret, created next to the chart: README.md, "Install on Kubernetes".
  metrics_token_secret_name = "${local.helm_fullname}-metrics-token"

  dcgm_exporter_service_monitor = var.enable_kube_prometheus_stack || var.dcgm_exporter_service_monitor

  # NVIDIA's dcgm-exporter chart (deployment/values.yaml): a DaemonSet on every node its
  # nodeSelector and tolerations admit, a Service on 9400, and a ServiceMonitor whose endpoint
  # takes `honorLabels` from serviceMonitor.honorLabels (false by default).
  dcgm_exporter_values = {
    nodeSelector = local.gpu_node_labels
    tolerations  = local.gpu_daemonset_tolerations
    serviceMonitor = {
      enabled     = local.dcgm_exporter_service_monitor
      honorLabels = true
      interval    = "15s"
    }
  }

  kube_prometheus_stack_values = {
    prometheus = {
      prometheusSpec = {
        # Every ServiceMonitor and PodMonitor in the cluster, not only those labelled with this
        # release: dcgm-exporter's and the spotrl chart's need no `release` label.
        serviceMonitorSelectorNilUsesHelmValues = false
        podMonitorSelectorNilUsesHelmValues     = false
        retention                               = var.prometheus_retention
      }
    }
    grafana = {
      sidecar = {
        dashboards = {
          enabled    = true
          label      = local.grafana_dashboards.label
          labelValue = local.grafana_dashboards.labelValue
          # The chart's ConfigMaps live in the spotrl namespace, not Grafana's.
          searchNamespace = "ALL"
          # The folder a ConfigMap names in this annotation is the dashboard's Grafana folder.
          folderAnnotation = local.grafana_folder_annotation
          provider = {
            foldersFromFilesStructure = true
          }
        }
      }
    }
  }

  # What helm_values adds with kube-prometheus-stack: the API's ServiceMonitor and the dashboards,
  # as the sidecar above looks for them.
  monitoring_helm_values = {
    serviceMonitor = {
      enabled           = true
      bearerTokenSecret = { name = local.metrics_token_secret_name }
    }
    dashboards = merge({ enabled = true }, local.grafana_dashboards)
  }
}

resource "random_password" "grafana" {
  count = var.enable_kube_prometheus_stack ? 1 : 0

  length  = 32
  special = false
}

resource "helm_release" "kube_prometheus_stack" {
  count = var.enable_kube_prometheus_stack ? 1 : 0

  namespace        = var.monitoring_namespace
  create_namespace = true
  name             = "kube-prometheus-stack"
  repository       = "https://prometheus-community.github.io/helm-charts"
  chart            = "kube-prometheus-stack"
  version          = var.kube_prometheus_stack_chart_version

  values = [yamlencode(local.kube_prometheus_stack_values)]

  set_sensitive = [{
    name  = "grafana.adminPassword"
    value = random_password.grafana[0].result
  }]

  depends_on = [helm_release.karpenter]
}

resource "helm_release" "dcgm_exporter" {
  count = var.enable_dcgm_exporter ? 1 : 0

  namespace        = var.monitoring_namespace
  create_namespace = true
  name             = "dcgm-exporter"
  repository       = "https://nvidia.github.io/dcgm-exporter/helm-charts"
  chart            = "dcgm-exporter"
  version          = var.dcgm_exporter_chart_version

  values = [yamlencode(local.dcgm_exporter_values)]

  # Its ServiceMonitor needs the Prometheus Operator's CRDs, which kube-prometheus-stack installs.
  depends_on = [helm_release.kube_prometheus_stack, helm_release.nvidia_device_plugin]
}
