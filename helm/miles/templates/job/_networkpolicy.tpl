{{/*
Per-job ingress: each per-job pod component (engine, weight-sync daemons in daemonset mode, weight-sync origin,
trainer, multi-node engine workers with leaderWorkerSet; the environment server in its own template,
_envserver.tpl, for jobs that have one) accepts the per-job flows only from pods of the same job (platform-wide
flows, e.g. router -> engine, come from the shared policies), so two jobs never reach each other's pods.
*/}}
{{- define "miles.job.networkPolicy" -}}
{{- $targets := list "engine" "weight-sync-origin" "trainer" -}}
{{- if eq .Values.jobTemplates.weightSync.mode "daemonset" }}{{ $targets = append $targets "weight-sync" }}{{ end -}}
{{- if .Values.leaderWorkerSet.enabled }}{{ $targets = append $targets "engine-worker" }}{{ end -}}
{{- range $target := $targets }}
---
{{ include "miles.job.ingressPolicy" (dict "root" $ "target" $target) }}
{{- end }}
{{- end -}}

{{/* The per-job ingress policy of one pod component (.target): the perJob flows to it, from the same job's pods. */}}
{{- define "miles.job.ingressPolicy" -}}
{{- $root := .root -}}
{{- $target := .target -}}
{{- $rules := list }}
{{- range $flow := include "miles.flows" $root | fromYamlArray }}
{{- if and $flow.perJob (eq (include "miles.podComponent" (dict "root" $root "component" $flow.to)) $target) }}
{{- $fromPod := include "miles.podComponent" (dict "root" $root "component" $flow.from) }}
{{- $selector := include "miles.job.selectorLabels" (dict "root" $root "component" $fromPod) | fromYaml }}
{{- $rules = append $rules (merge (dict "from" (list (dict "podSelector" (dict "matchLabels" $selector)))) (include "miles.flowPorts" $flow | fromYaml)) }}
{{- end }}
{{- end -}}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "miles.job.name" (dict "root" $root "component" $target) }}-ingress
  labels:
    {{- include "miles.job.labels" (dict "root" $root "component" $target) | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "miles.job.selectorLabels" (dict "root" $root "component" $target) | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    {{- toYaml ($rules | uniq) | nindent 4 }}
{{- end -}}
