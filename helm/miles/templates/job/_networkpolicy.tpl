{{/*
Per-job ingress: each per-job pod component (engine, weight-sync daemons in daemonset mode, weight-sync origin,
trainer) accepts the per-job flows only from pods of the same job (platform-wide flows, e.g. router -> engine,
come from the shared policies), so two jobs never reach each other's pods.
*/}}
{{- define "miles.job.networkPolicy" -}}
{{- $flows := include "miles.flows" . | fromYamlArray -}}
{{- $targets := list "engine" "weight-sync-origin" "trainer" -}}
{{- if eq .Values.jobTemplates.weightSync.mode "daemonset" }}{{ $targets = append $targets "weight-sync" }}{{ end -}}
{{- range $target := $targets }}
{{- $rules := list }}
{{- range $flow := $flows }}
{{- if and $flow.perJob (eq (include "miles.podComponent" (dict "root" $ "component" $flow.to)) $target) }}
{{- $fromPod := include "miles.podComponent" (dict "root" $ "component" $flow.from) }}
{{- $selector := include "miles.job.selectorLabels" (dict "root" $ "component" $fromPod) | fromYaml }}
{{- $rules = append $rules (merge (dict "from" (list (dict "podSelector" (dict "matchLabels" $selector)))) (include "miles.flowPorts" $flow | fromYaml)) }}
{{- end }}
{{- end }}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "miles.job.name" (dict "root" $ "component" $target) }}-ingress
  labels:
    {{- include "miles.job.labels" (dict "root" $ "component" $target) | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "miles.job.selectorLabels" (dict "root" $ "component" $target) | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    {{- toYaml ($rules | uniq) | nindent 4 }}
{{- end }}
{{- end -}}
