{{/* Names and labels. */}}
{{- define "ballast.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ballast.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ballast.labels" -}}
{{ include "ballast.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "ballast.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ballast.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ballast.image" -}}
{{- printf "%s:%s" .repository (default .appVersion .tag) -}}
{{- end -}}

{{/* The name a model is served under, as config.EngineSettings.model_name has it. */}}
{{- define "ballast.servedName" -}}
{{- default (.model | trimSuffix "/" | splitList "/" | last) .servedName -}}
{{- end -}}

{{/* Secret names: the one the operator named, else the chart's. */}}
{{- define "ballast.ownerSecret" -}}
{{- default (printf "%s-db-owner" (include "ballast.fullname" .)) .Values.database.owner.existingSecret -}}
{{- end -}}
{{- define "ballast.serviceSecret" -}}
{{- default (printf "%s-db-service" (include "ballast.fullname" .)) .Values.database.service.existingSecret -}}
{{- end -}}
{{- define "ballast.engineTokenSecret" -}}
{{- default (printf "%s-engine-token" (include "ballast.fullname" .)) .Values.engineToken.existingSecret -}}
{{- end -}}
{{- define "ballast.metricsTokenSecret" -}}
{{- default (printf "%s-metrics-token" (include "ballast.fullname" .)) .Values.metricsToken.existingSecret -}}
{{- end -}}
{{- define "ballast.temporalTLSSecret" -}}
{{- default (printf "%s-temporal-tls" (include "ballast.fullname" .)) .Values.temporal.tls.existingSecret -}}
{{- end -}}
{{- define "ballast.temporalAPIKeySecret" -}}
{{- default (printf "%s-temporal-api-key" (include "ballast.fullname" .)) .Values.temporal.apiKey.existingSecret -}}
{{- end -}}
{{- define "ballast.temporalClientCert" -}}
{{- if or .Values.temporal.tls.existingSecret .Values.temporal.tls.clientCert }}true{{ end -}}
{{- end -}}
{{- define "ballast.temporalServerCAKey" -}}
{{- if .Values.temporal.tls.existingSecret }}{{ .Values.temporal.tls.serverCAKey }}{{ else if .Values.temporal.tls.serverCA }}ca.crt{{ end -}}
{{- end -}}
{{- define "ballast.temporalAPIKey" -}}
{{- if or .Values.temporal.apiKey.existingSecret .Values.temporal.apiKey.value }}true{{ end -}}
{{- end -}}

{{/*
What every Ballast container gets, the model first: one source, so the api, the control
worker, the migration and the release model's pools cannot disagree. For an engine pool,
`model`, `servedName`, `maxModelLen` and `task` are the pool's (default: the release model's).
*/}}
{{- define "ballast.env.common" -}}
{{- $ := .root -}}
- name: BALLAST_MODEL
  value: {{ default $.Values.model.name .model | quote }}
{{- with default $.Values.model.servedName .servedName }}
- name: BALLAST_SERVED_MODEL_NAME
  value: {{ . | quote }}
{{- end }}
- name: BALLAST_MAX_MODEL_LEN
  value: {{ default $.Values.model.maxModelLen .maxModelLen | quote }}
- name: BALLAST_MODEL_TASK
  value: {{ default (default "generate" $.Values.model.task) .task | quote }}
- name: HF_HOME
  value: /data/models/hf
- name: BALLAST_DATA_DIR
  value: /data
- name: BALLAST_OBJECT_STORE
  value: {{ required "objectStore.url: an object store every pod reaches (s3://bucket/prefix)" $.Values.objectStore.url | quote }}
- name: BALLAST_CONTROL_QUEUE
  value: {{ $.Values.temporal.controlQueue | quote }}
- name: BALLAST_ENGINE_QUEUE
  value: {{ $.Values.temporal.engineQueue | quote }}
- name: TEMPORAL_ADDRESS
  value: {{ required "temporal.address: the Temporal frontend (host:port)" $.Values.temporal.address | quote }}
- name: TEMPORAL_NAMESPACE
  value: {{ $.Values.temporal.namespace | quote }}
{{- with $.Values.database.sslMode }}
- name: PGSSLMODE
  value: {{ . | quote }}
{{- end }}
{{- range $k, $v := $.Values.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* The long-running processes: Temporal's TLS and API key, the object store's endpoint and credentials. */}}
{{- define "ballast.env.temporal" -}}
{{- if .Values.temporal.tls.enabled }}
- name: TEMPORAL_TLS
  value: "true"
{{- with .Values.temporal.tls.serverName }}
- name: TEMPORAL_TLS_SERVER_NAME
  value: {{ . | quote }}
{{- end }}
{{- if include "ballast.temporalClientCert" . }}
- name: TEMPORAL_TLS_CLIENT_CERT_PATH
  value: /etc/ballast/temporal-tls/tls.crt
- name: TEMPORAL_TLS_CLIENT_KEY_PATH
  value: /etc/ballast/temporal-tls/tls.key
{{- end }}
{{- with include "ballast.temporalServerCAKey" . }}
- name: TEMPORAL_TLS_SERVER_CA_CERT_PATH
  value: /etc/ballast/temporal-tls/{{ . }}
{{- end }}
{{- end }}
{{- if include "ballast.temporalAPIKey" . }}
- name: TEMPORAL_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "ballast.temporalAPIKeySecret" . }}
      key: {{ .Values.temporal.apiKey.key }}
{{- end }}
{{- with .Values.objectStore.endpoint }}
- name: AWS_ENDPOINT_URL_S3
  value: {{ . | quote }}
{{- end }}
{{- with .Values.objectStore.region }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "ballast.envFrom.objectStore" -}}
{{- with .Values.objectStore.credentialsSecret }}
envFrom:
  - secretRef:
      name: {{ . }}
{{- end }}
{{- end -}}

{{/* A service's own role's URL, for the api and each worker (never the owner's nor another's): (dict "root" . "kind" "api"). */}}
{{- define "ballast.env.serviceDatabase" -}}
{{- $key := index .root.Values.database.service (printf "%sUrlKey" .kind) -}}
- name: BALLAST_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "ballast.serviceSecret" .root }}
      key: {{ $key }}
- name: BALLAST_SERVICE_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "ballast.serviceSecret" .root }}
      key: {{ $key }}
{{- end -}}

{{- define "ballast.env.metricsToken" -}}
- name: BALLAST_METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "ballast.metricsTokenSecret" . }}
      key: {{ .Values.metricsToken.key }}
{{- end -}}

{{- define "ballast.env.engineToken" -}}
- name: BALLAST_ENGINE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "ballast.engineTokenSecret" . }}
      key: {{ .Values.engineToken.key }}
{{- end -}}

{{- define "ballast.volumeMounts" -}}
{{- $ := .root -}}
- name: models
  mountPath: /data/models
  readOnly: {{ and .readOnly (ne $.Values.model.cache.existingClaim "") }}
- name: tmp
  mountPath: /tmp
{{- if and $.Values.temporal.tls.enabled (or (include "ballast.temporalClientCert" $) (include "ballast.temporalServerCAKey" $)) }}
- name: temporal-tls
  mountPath: /etc/ballast/temporal-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "ballast.volumes" -}}
- name: models
{{- with .Values.model.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ . }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if and .Values.temporal.tls.enabled (or (include "ballast.temporalClientCert" .) (include "ballast.temporalServerCAKey" .)) }}
- name: temporal-tls
  secret:
    secretName: {{ include "ballast.temporalTLSSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* Offline when the engines' cache is shared: the tokenizer comes from their download. */}}
{{- define "ballast.env.hubOffline" -}}
{{- if .Values.model.cache.existingClaim }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- end -}}
