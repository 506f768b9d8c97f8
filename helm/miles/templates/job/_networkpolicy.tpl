{{/*
Per-job ingress: the job's engines, weight-sync and trainer accept the per-job flows only from pods of the same
job (the platform-wide flows, e.g. router -> engine, come from the shared policies), so two jobs never reach
each other's pods. One policy per destination; in sidecar mode weight-sync runs inside the engine pods.
*/}}
{{- define "miles.job.networkPolicy" -}}
{{- $flows := include "miles.flows" . | fromYamlArray -}}
{{- range $target := list "engine" "weight-sync" "trainer" }}
{{- $podComponent := include "miles.podComponent" (dict "root" $ "component" $target) }}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "miles.job.name" (dict "root" $ "component" $target) }}-ingress
  labels:
    {{- include "miles.job.labels" (dict "root" $ "component" $podComponent) | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "miles.job.selectorLabels" (dict "root" $ "component" $podComponent) | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    {{- range $flow := $flows }}
    {{- $fromPod := include "miles.podComponent" (dict "root" $ "component" $flow.from) }}
    {{- $localhost := and (ne $flow.from $flow.to) (eq $fromPod $podComponent) }}
    {{- if and $flow.perJob (eq $flow.to $target) (not $localhost) }}
    - from:
        - podSelector:
            matchLabels:
              {{- include "miles.job.selectorLabels" (dict "root" $ "component" $fromPod) | nindent 14 }}
      ports: [{protocol: TCP, port: {{ $flow.port }}}]
    {{- end }}
    {{- end }}
{{- end }}
{{- end -}}
