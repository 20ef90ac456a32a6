{{/* edgecloud chart helpers: names, labels, the image, and the checks that fail a bad install. */}}
{{- define "edgecloud.name" -}}{{ .Chart.Name }}{{- end -}}

{{- define "edgecloud.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "edgecloud.labels" -}}
app.kubernetes.io/name: {{ include "edgecloud.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "edgecloud.selector" -}}
app.kubernetes.io/name: {{ include "edgecloud.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* the image of a role: REPOSITORY-ROLE:TAG */}}
{{- define "edgecloud.image" -}}
{{ printf "%s-%s:%s" .root.Values.image.repository .role (.root.Values.image.tag | default .root.Chart.AppVersion) }}
{{- end -}}

{{/* the secrets every gateway and node reads from its environment */}}
{{- define "edgecloud.secretEnv" -}}
- name: EDGECLOUD_NODE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.nodeToken.existingSecret }}
      key: {{ .Values.nodeToken.key }}
{{- if .Values.redis.existingSecret }}
- name: EDGECLOUD_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.passwordKey }}
{{- end }}
{{- end -}}

{{/* checks: a missing Redis URL or node token, GPUs that do not match TP x PP */}}
{{- define "edgecloud.validate" -}}
{{- if not .Values.redis.url -}}
{{- fail "redis.url is required: the fleet store every gateway and node shares (redis:// or rediss://)" -}}
{{- end -}}
{{- if not .Values.nodeToken.existingSecret -}}
{{- fail "nodeToken.existingSecret is required: a Secret holding the node token (32+ random characters)" -}}
{{- end -}}
{{- if .Values.cloud.enabled -}}
{{- $ranks := mul (int .Values.cloud.tp) (int .Values.cloud.pp) -}}
{{- $gpus := int .Values.cloud.gpus -}}
{{- if and (gt $gpus 0) (ne $gpus $ranks) -}}
{{- fail (printf "cloud.gpus (%d) must be cloud.tp x cloud.pp (%d x %d = %d): one GPU per rank" $gpus (int .Values.cloud.tp) (int .Values.cloud.pp) $ranks) -}}
{{- end -}}
{{- if and (eq $gpus 0) (gt $ranks 1) -}}
{{- fail "cloud.tp x cloud.pp > 1 needs cloud.gpus: parallel ranks run one per GPU" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.monitoring.serviceMonitor.enabled (ne (.Values.gateway.config.observability | default "loopback") "open") (not .Values.monitoring.serviceMonitor.adminKeySecret) -}}
{{- fail "monitoring.serviceMonitor.adminKeySecret is required while gateway.config.observability is not 'open': /metrics then needs an admin key" -}}
{{- end -}}
{{- end -}}
