{{- define "twinmq.fullname" -}}
{{- printf "%s-twinmq" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "twinmq.labels" -}}
app.kubernetes.io/name: twinmq
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "twinmq.brokerSelector" -}}
app.kubernetes.io/name: twinmq
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: broker
{{- end -}}
