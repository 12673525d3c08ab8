{{/* Chart name, overridable. */}}
{{- define "gengate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, or the release name when it already contains the chart name. */}}
{{- define "gengate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The headless Service's name (client-side round_robin target). */}}
{{- define "gengate.headlessName" -}}
{{- printf "%s-headless" (include "gengate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gengate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gengate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gengate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gengate.labels" -}}
helm.sh/chart: {{ include "gengate.chart" . }}
{{ include "gengate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "gengate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gengate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gengate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* A grpc probe body: grpc.health.v1 Check on the container port. Call with (dict "probe" ...). */}}
{{- define "gengate.grpcProbe" -}}
grpc:
  port: 50051
  service: {{ .probe.service | quote }}
periodSeconds: {{ .probe.periodSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
timeoutSeconds: 3
{{- end }}

{{/* A Prometheus duration (values.schema.json's: units y w d h m s ms, each once, in that order)
in milliseconds, to compare two of them. */}}
{{- define "gengate.durationMs" -}}
{{- $ms := regexFind "[0-9]+ms$" . | trimSuffix "ms" | default "0" | int64 }}
{{- $rest := regexReplaceAll "[0-9]+ms$" . "" }}
{{- range $unit, $factor := dict "y" 31536000000 "w" 604800000 "d" 86400000 "h" 3600000 "m" 60000 "s" 1000 }}
{{- $ms = add $ms (mul (regexFind (printf "[0-9]+%s" $unit) $rest | trimSuffix $unit | default "0" | int64) $factor) }}
{{- end }}
{{- $ms }}
{{- end }}
