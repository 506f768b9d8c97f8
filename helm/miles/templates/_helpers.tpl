{{/*
Shared name, label, image and pod-spec helpers. Every template renders one Kubernetes kind for one component;
the component's values live under .Values.<componentKey> (see values.yaml).
*/}}

{{- define "miles.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "miles.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "miles.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "miles.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: <fullname>-<component>, e.g. miles-session-server. */}}
{{- define "miles.componentName" -}}
{{- printf "%s-%s" (include "miles.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "miles.selectorLabels" -}}
app.kubernetes.io/name: {{ include "miles.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "miles.labels" -}}
{{ include "miles.selectorLabels" . }}
app.kubernetes.io/part-of: miles
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Image reference: <registry>/<repository>:<tag>, tag defaulting to the chart's appVersion. */}}
{{- define "miles.image" -}}
{{- $registry := .root.Values.global.imageRegistry -}}
{{- $tag := .image.tag | default .root.Values.global.imageTag | default .root.Chart.AppVersion -}}
{{- if $registry -}}
{{- printf "%s/%s:%s" $registry .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The Redis URL every Redis-backed service gets (internal StatefulSet or external). */}}
{{- define "miles.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:%d/0" (include "miles.fullname" .) (int .Values.redis.port) -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Name of the Secret holding API tokens (and the Redis URL when it carries credentials). */}}
{{- define "miles.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "miles.fullname" .)) -}}
{{- end -}}

{{/* Pod-level security context shared by every miles pod (non-root, seccomp RuntimeDefault). */}}
{{- define "miles.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container-level security context: no privilege escalation, read-only root, every capability dropped. */}}
{{- define "miles.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* nodeSelector / tolerations / affinity of a node pool (a key of nodePools: cpu, rollout, trainer or one added). */}}
{{- define "miles.nodePlacement" -}}
{{- $pool := index .root.Values.nodePools .pool | required (printf "unknown node pool %q" .pool) -}}
{{- with $pool.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $pool.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $pool.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The release's node pools as JSON, for jobs that name one (resources.<pool>.node_pool): {"pools": {name:
{nodeSelector, tolerations, affinity}}}, unset parts as {} / []. Stored in the job-templates ConfigMap under
node-pools.json (job_templates.NODE_POOLS_KEY), never instantiated; miles.nodePlacement renders the same fields.
*/}}
{{- define "miles.nodePools.templatesJson" -}}
{{- $pools := dict -}}
{{- range $name, $pool := .Values.nodePools -}}
{{- $_ := set $pools $name (dict "nodeSelector" ($pool.nodeSelector | default dict) "tolerations" ($pool.tolerations | default list) "affinity" ($pool.affinity | default dict)) -}}
{{- end -}}
{{- toJson (dict "pools" $pools) -}}
{{- end -}}

{{/*
Environment of a service container: every key of .settings becomes MILES_<PREFIX>_<KEY> (the pydantic-settings
field of the same name); lists and maps are passed as JSON, which pydantic-settings parses.
*/}}
{{- define "miles.settingsEnv" -}}
{{- range $key, $value := .settings }}
- name: {{ printf "MILES_%s_%s" $.prefix ($key | upper) }}
  {{- if or (kindIs "map" $value) (kindIs "slice" $value) }}
  value: {{ toJson $value | quote }}
  {{- else }}
  value: {{ $value | toString | quote }}
  {{- end }}
{{- end }}
{{- end -}}
