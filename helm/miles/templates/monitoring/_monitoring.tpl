{{/*
Prometheus-operator objects. Every series gets a `component` label (the app.kubernetes.io/component of its pod or
Service); per-job series also get `job_id` (the pod's miles.dev/job label), so dashboards and alerts select a job
the same way for the buffer (which labels its own series job_id), trainers, engines and workers.
*/}}
{{- define "miles.serviceMonitor" -}}
{{- $c := index .root.Values .key -}}
{{- $ctx := dict "root" .root "component" .component -}}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "miles.componentName" $ctx }}
  labels:
    {{- include "miles.labels" $ctx | nindent 4 }}
    {{- with .root.Values.monitoring.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "miles.selectorLabels" $ctx | nindent 6 }}
  endpoints:
    - port: {{ ternary "metrics" "http" (hasKey $c.ports "metrics") }}
      path: /metrics
      interval: {{ .root.Values.monitoring.serviceMonitor.interval }}
      relabelings:
        - sourceLabels: [__meta_kubernetes_service_label_app_kubernetes_io_component]
          targetLabel: component
{{- end -}}
