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

{{- define "twinmq.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "twinmq.operatorName" -}}
{{- printf "%s-operator" (include "twinmq.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "twinmq.operatorSelector" -}}
app.kubernetes.io/name: twinmq
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "twinmq.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- .Values.operator.serviceAccount.name | default (include "twinmq.operatorName" .) -}}
{{- else -}}
{{- .Values.operator.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "twinmq.rbacScope" -}}
{{- $scope := .Values.operator.rbac.scope -}}
{{- if not (has $scope (list "cluster" "namespace")) -}}
{{- fail (printf "operator.rbac.scope must be \"cluster\" or \"namespace\", not %q" $scope) -}}
{{- end -}}
{{- $scope -}}
{{- end -}}
