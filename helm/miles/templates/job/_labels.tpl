{{/* Labels of a per-job object: the component labels plus the job id placeholder. */}}
{{- define "miles.job.labels" -}}
{{ include "miles.labels" . }}
miles.dev/job: ${JOB_ID}
{{- end -}}

{{- define "miles.job.selectorLabels" -}}
{{ include "miles.selectorLabels" . }}
miles.dev/job: ${JOB_ID}
{{- end -}}

{{/* Name of a per-job object: <fullname>-${JOB_ID}-<component>. The controller keeps job ids short enough. */}}
{{- define "miles.job.name" -}}
{{- printf "%s-${JOB_ID}-%s" (include "miles.fullname" .root) .component -}}
{{- end -}}

{{/* Env every per-job container gets: the job id and where the shared services are. */}}
{{- define "miles.job.commonEnv" -}}
- name: MILES_JOB_ID
  value: "${JOB_ID}"
- name: MILES_SESSION_SERVER_URL
  value: {{ printf "http://%s-session-server:%v" (include "miles.fullname" .) .Values.sessionServer.ports.http | quote }}
- name: MILES_ROUTER_URL
  value: {{ printf "http://%s-rollout-router:%v" (include "miles.fullname" .) .Values.rolloutRouter.ports.http | quote }}
- name: MILES_BUFFER_ADDRESS
  value: {{ printf "%s-buffer:%v" (include "miles.fullname" .) .Values.buffer.ports.grpc | quote }}
- name: MILES_SANDBOX_ADDRESS
  value: {{ printf "%s-sandbox-gateway:%v" (include "miles.fullname" .) .Values.sandboxGateway.ports.grpc | quote }}
- name: MILES_JOB_SPEC_PATH
  value: /etc/miles/job/spec.json
{{- if .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
{{- end }}
{{- end -}}

{{/* The job spec volume (the ConfigMap the controller creates per job and owns everything else with). */}}
{{- define "miles.job.specVolume" -}}
- name: job-spec
  configMap:
    name: {{ include "miles.job.name" (dict "root" . "component" "spec") }}
{{- end -}}
