{{/*
Names. Kubernetes names (and label values) stop at 63 characters (DNS-1123 labels), so every
name is truncated to 63 and a trailing "-" left by the cut is trimmed. Component objects append
a suffix to the fullname, so the fullname is cut shorter (52) to leave room for the longest
suffix ("-scheduler", "-postgresql" plus its pod hash) without a second truncation that could make
two components' names collide.
*/}}
{{- define "spotrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "spotrl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>": the name of a component's objects. Call with (list $ "api"). */}}
{{- define "spotrl.componentName" -}}
{{- printf "%s-%s" (include "spotrl.fullname" (index . 0)) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "spotrl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: name and instance only (plus the component), so they never change on upgrade. */}}
{{- define "spotrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spotrl.name" (index . 0) }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Every object's labels. Call with (list $ "component"). */}}
{{- define "spotrl.labels" -}}
{{- $ := index . 0 -}}
helm.sh/chart: {{ include "spotrl.chart" $ }}
{{ include "spotrl.selectorLabels" . }}
app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $.Release.Service }}
app.kubernetes.io/part-of: spotrl
{{- with $.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* An image reference, `<registry>/<repository>:<tag>[@<digest>]`. Call with (list $ .Values.image.control). */}}
{{- define "spotrl.image" -}}
{{- $ := index . 0 }}
{{- $image := index . 1 }}
{{- $registry := default $.Values.image.registry $image.registry }}
{{- $tag := default $.Chart.AppVersion (default $.Values.image.tag $image.tag) }}
{{- if $registry }}{{ printf "%s/%s:%s" $registry $image.repository $tag }}{{ else }}{{ printf "%s:%s" $image.repository $tag }}{{ end }}
{{- with $image.digest }}@{{ . }}{{ end }}
{{- end }}

{{- define "spotrl.imagePullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* Service accounts: the API, the scheduler, and the pods the scheduler launches. */}}
{{- define "spotrl.serviceAccountName" -}}
{{- include "spotrl.componentName" . }}
{{- end }}

{{/* The Secret with the backends' URLs (and S3 keys): the chart's own or the user's. */}}
{{- define "spotrl.backendsSecretName" -}}
{{- default (include "spotrl.componentName" (list . "backends")) .Values.backends.existingSecret }}
{{- end }}

{{/* Secrets every spotrl process reads its environment from (envFrom), in order. */}}
{{- define "spotrl.envSecretNames" -}}
{{- $names := list (include "spotrl.backendsSecretName" .) }}
{{- if .Values.s3.accessKey.existingSecret }}
{{- $names = append $names .Values.s3.accessKey.existingSecret }}
{{- end }}
{{- join "," $names }}
{{- end }}

{{- define "spotrl.envFrom" -}}
envFrom:
  - configMapRef:
      name: {{ include "spotrl.componentName" (list . "settings") }}
{{- range (splitList "," (include "spotrl.envSecretNames" .)) }}
  - secretRef:
      name: {{ . }}
{{- end }}
{{- end }}

{{- define "spotrl.tokensSecretName" -}}
{{- default (include "spotrl.componentName" (list . "tokens")) .Values.auth.existingSecret }}
{{- end }}

{{- define "spotrl.catalogConfigMapName" -}}
{{- default (include "spotrl.componentName" (list . "price-catalog")) .Values.priceCatalog.existingConfigMap }}
{{- end }}

{{/* The price catalog: the one shipped with spotrl, with the user's instances merged over it. */}}
{{- define "spotrl.priceCatalog" -}}
{{- $catalog := .Files.Get "files/catalog.json" | fromJson }}
{{- $instances := merge (deepCopy .Values.priceCatalog.instances) $catalog.instances }}
{{- $_ := set $catalog "instances" $instances }}
{{- if .Values.priceCatalog.currency }}{{ $_ := set $catalog "currency" .Values.priceCatalog.currency }}{{ end }}
{{- toPrettyJson $catalog }}
{{- end }}

{{/* The reward service's URL, when the chart runs one. */}}
{{- define "spotrl.rewardServiceUrl" -}}
{{- printf "http://%s.%s.svc:%v" (include "spotrl.componentName" (list . "reward")) .Release.Namespace .Values.reward.service.port }}
{{- end }}

{{/* The reward service's image: the user's (reward.image, holding their reward code and spotrl),
else the chart's rollout image. The user's registry does not default to image.registry: it is
not a spotrl image. */}}
{{- define "spotrl.rewardImage" -}}
{{- $image := .Values.reward.image }}
{{- if $image.repository }}
{{- if not (or $image.tag $image.digest) }}
{{- fail "reward.image.tag or reward.image.digest is required with reward.image.repository" }}
{{- end }}
{{- $ref := $image.repository }}
{{- if $image.registry }}{{ $ref = printf "%s/%s" (trimSuffix "/" $image.registry) $ref }}{{ end }}
{{- if $image.tag }}{{ $ref = printf "%s:%s" $ref $image.tag }}{{ end }}
{{- if $image.digest }}{{ $ref = printf "%s@%s" $ref $image.digest }}{{ end }}
{{- $ref }}
{{- else }}
{{- include "spotrl.image" (list . .Values.image.rollout) }}
{{- end }}
{{- end }}

{{/* Resources of a reward function's container: reward.function.resources, else no GPU, one CPU
per worker, and memory for every worker at its address-space limit (memoryMb) plus 512 MiB for
the server and its forkserver, requested and limited alike so that the limit the workers run
under is what the node sets aside. */}}
{{- define "spotrl.rewardFunctionResources" -}}
{{- $function := .Values.reward.function }}
{{- if $function.resources }}
{{- toYaml $function.resources }}
{{- else }}
{{- if not (int $function.memoryMb) }}
{{- fail "reward.function.memoryMb 0 (no limit per worker) needs reward.function.resources: the chart sizes the pod from workers × memoryMb" }}
{{- end }}
{{- $memory := printf "%dMi" (add (mul (int $function.workers) (int $function.memoryMb)) 512) }}
requests:
  cpu: {{ int $function.workers | quote }}
  memory: {{ $memory }}
limits:
  memory: {{ $memory }}
{{- end }}
{{- end }}

{{/* A container's writable scratch space under a read-only root filesystem. */}}
{{- define "spotrl.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{/* The backends' URLs: the user's, else the trial server's, else a clear failure. */}}
{{- define "spotrl.stateUrl" -}}
{{- if .Values.backends.stateUrl }}{{ .Values.backends.stateUrl }}
{{- else if .Values.trial.postgresql.enabled }}
{{- printf "postgresql+psycopg://spotrl:%s@%s:5432/spotrl" (required "trial.postgresql.password is required with trial.postgresql.enabled" .Values.trial.postgresql.password) (include "spotrl.componentName" (list . "postgresql")) }}
{{- else }}{{ fail "set backends.stateUrl (PostgreSQL), backends.existingSecret, or trial.postgresql.enabled" }}
{{- end }}
{{- end }}

{{- define "spotrl.queueUrl" -}}
{{- if .Values.backends.queueUrl }}{{ .Values.backends.queueUrl }}
{{- else if .Values.trial.kafka.enabled }}{{ printf "kafka://%s:9092" (include "spotrl.componentName" (list . "kafka")) }}
{{- else }}{{ fail "set backends.queueUrl (Kafka), backends.existingSecret, or trial.kafka.enabled" }}
{{- end }}
{{- end }}

{{- define "spotrl.rewardCacheUrl" -}}
{{- if .Values.backends.rewardCacheUrl }}{{ .Values.backends.rewardCacheUrl }}
{{- else if .Values.trial.redis.enabled }}{{ printf "redis://%s:6379/0" (include "spotrl.componentName" (list . "redis")) }}
{{- else }}{{ fail "set backends.rewardCacheUrl (Redis), backends.existingSecret, or trial.redis.enabled" }}
{{- end }}
{{- end }}

{{/* Pod template parts shared by the API and the scheduler. Call with (list $ "api" .Values.api). */}}
{{- define "spotrl.controlPodSpec" -}}
{{- $ := index . 0 }}
{{- $values := index . 2 }}
serviceAccountName: {{ include "spotrl.serviceAccountName" (list $ (index . 1)) }}
enableServiceLinks: false
securityContext:
  {{- toYaml $.Values.podSecurityContext | nindent 2 }}
{{- include "spotrl.imagePullSecrets" $ }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  {{- include "spotrl.tmpVolume" $ | nindent 2 }}
  - name: price-catalog
    configMap:
      name: {{ include "spotrl.catalogConfigMapName" $ }}
{{- end }}

{{- define "spotrl.controlVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: price-catalog
  mountPath: /etc/spotrl/catalog
  readOnly: true
{{- end }}

{{/* Checksums of the configuration a pod reads at start, so that a change rolls the pods. */}}
{{- define "spotrl.configChecksums" -}}
checksum/settings: {{ include (print .Template.BasePath "/settings-configmap.yaml") . | sha256sum }}
checksum/secrets: {{ include (print .Template.BasePath "/secrets.yaml") . | sha256sum }}
checksum/price-catalog: {{ include (print .Template.BasePath "/price-catalog-configmap.yaml") . | sha256sum }}
{{- end }}

{{/* A pool's node selector: its own labels plus the capacity label of pools.capacityLabel.
Call with (list $ "rollout"). Kept apart from the pools' maps because Helm merges maps: a default
capacity label inside them would survive a user's own selector and match no node. */}}
{{- define "spotrl.poolNodeSelector" -}}
{{- $ := index . 0 }}
{{- $pool := index . 1 }}
{{- $capacity := dict
  "karpenter" (dict "rollout" (dict "karpenter.sh/capacity-type" "spot") "training" (dict "karpenter.sh/capacity-type" "on-demand"))
  "eks" (dict "rollout" (dict "eks.amazonaws.com/capacityType" "SPOT") "training" (dict "eks.amazonaws.com/capacityType" "ON_DEMAND"))
  "gke" (dict "rollout" (dict "cloud.google.com/gke-spot" "true"))
  "none" (dict) }}
{{- $labels := index (index $capacity $.Values.pools.capacityLabel) $pool | default dict }}
{{- toJson (merge (deepCopy (index $.Values.pools $pool).nodeSelector) $labels) }}
{{- end }}
