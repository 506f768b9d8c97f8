{{/* Labels, names and shared pieces of per-job objects. ${JOB_ID} is filled by the controller. */}}
{{- define "miles.job.labels" -}}
{{ include "miles.labels" . }}
miles.dev/job: ${JOB_ID}
{{- end -}}

{{- define "miles.job.selectorLabels" -}}
{{ include "miles.selectorLabels" . }}
miles.dev/job: ${JOB_ID}
{{- end -}}

{{/* Name of a per-job object: <fullname>-${JOB_ID}-<component>. The controller checks the length per job. */}}
{{- define "miles.job.name" -}}
{{- printf "%s-${JOB_ID}-%s" (include "miles.fullname" .root) .component -}}
{{- end -}}

{{/* In-cluster address of a shared service: "http" -> http://<name>:<http port>, "grpc" -> <name>:<grpc port>. */}}
{{- define "miles.job.sharedAddress" -}}
{{- $c := index .root.Values .key -}}
{{- $host := printf "%s-%s" (include "miles.fullname" .root) (.key | kebabcase) -}}
{{- if eq .kind "grpc" -}}
{{- printf "%s:%v" $host $c.ports.grpc -}}
{{- else -}}
{{- printf "http://%s:%v" $host (index $c.ports .kind) -}}
{{- end -}}
{{- end -}}

{{/* gRPC address of the job's weight-sync origin (the trainer's publish target, every other daemon's origin). */}}
{{- define "miles.job.originAddress" -}}
{{- printf "%s:%v" (include "miles.job.name" (dict "root" . "component" "weight-sync-origin")) .Values.jobTemplates.weightSync.ports.grpc -}}
{{- end -}}

{{/* Env of every per-job container of service <prefix>: its settings file from the spec ConfigMap, tracing. */}}
{{- define "miles.job.baseEnv" -}}
- name: MILES_{{ .prefix }}_CONFIG_FILE
  value: /etc/miles/job/{{ .file }}
- name: MILES_{{ .prefix }}_JOB_ID
  value: "${JOB_ID}"
- name: MILES_{{ .prefix }}_HOST
  value: "0.0.0.0"
{{- if .root.Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .root.Values.tracing.otlpEndpoint | quote }}
{{- end }}
{{- end -}}

{{/* Env entries from the release Secret: .entries is a list of [env name, Secret key]. */}}
{{- define "miles.job.secretEnv" -}}
{{- range .entries }}
- name: {{ index . 0 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "miles.secretName" $.root }}
      key: {{ index . 1 }}
{{- end }}
{{- end -}}

{{/* Volumes every per-job pod has: the job's spec ConfigMap, /tmp, and the models volume when configured. */}}
{{- define "miles.job.commonVolumes" -}}
- name: job-spec
  configMap:
    name: {{ include "miles.job.name" (dict "root" .root "component" "spec") }}
- name: tmp
  emptyDir: {sizeLimit: {{ .tmpSize | default "5Gi" }}}
{{- with .root.Values.jobTemplates.modelVolume }}
- name: models
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "miles.job.commonMounts" -}}
- {name: job-spec, mountPath: /etc/miles/job, readOnly: true}
- {name: tmp, mountPath: /tmp}
{{- if .Values.jobTemplates.modelVolume }}
- {name: models, mountPath: {{ .Values.jobTemplates.modelMountPath }}, readOnly: true}
{{- end }}
{{- end -}}

{{/* Pod-level fields every per-job pod shares. */}}
{{- define "miles.job.podCommon" -}}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- include "miles.podSecurityContext" . | nindent 2 }}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
