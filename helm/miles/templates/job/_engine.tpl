{{/*
The engine pool of one job: SGLang pods on the rollout pool (or the CPU reference engine on the cpu pool), with
a weight-sync sidecar in sidecar mode, and the headless Service whose EndpointSlices the router discovers.
Per-job engine flags are not placeholders: the controller appends them to the args of the container named
"engine" after extraArgs (engine_args.with_engine_args), e.g. --enable-return-routed-experts for a job that
records MoE routing; a flag extraArgs already name is not added again. Keep the container's name and its args list.
*/}}
{{- define "miles.job.engineContainer" -}}
{{- $mounts := include "miles.job.engineMounts" . -}}
{{- include "miles.engineContainer" (dict "root" . "modelPath" "${MODEL_PATH}" "tpSize" "${TP_SIZE}" "gpus" "${ENGINE_GPUS}" "args" (list) "mounts" $mounts) -}}
{{- end -}}

{{- define "miles.job.engineMounts" -}}
{{- include "miles.job.commonMounts" . }}
- {name: shm, mountPath: /dev/shm}
{{- if ne .Values.jobTemplates.weightSync.mode "daemonset" }}
# The disk transport writes checkpoints here; the engine loads them from the same path.
- {name: weights, mountPath: /var/lib/miles/weights, readOnly: true}
{{- end }}
{{- end -}}

{{/*
The engine container of a job's engine pool and of a shared pool (shared-pools/_pools.tpl): .root, .modelPath,
.tpSize and .gpus (placeholders for a job, values for a shared pool), .args (appended after the chart's
jobTemplates.engine.<kind>.extraArgs) and .mounts (the volumeMounts list, as YAML); .worker (optional, true for
a non-leader pod of a multi-node engine, _engine_lws.tpl): no HTTP port or probes, as SGLang serves HTTP on the
leader only.
*/}}
{{- define "miles.engineContainer" -}}
{{- $root := .root -}}
{{- $e := $root.Values.jobTemplates.engine -}}
- name: engine
{{- if eq $e.kind "sglang" }}
  image: {{ printf "%s:%s" $e.sglang.image.repository $e.sglang.image.tag }}
  imagePullPolicy: {{ $root.Values.global.imagePullPolicy }}
  command: ["python3", "-m", "sglang.launch_server"]
  args:
    - --model-path
    - {{ .modelPath | quote }}
    - --host
    - "0.0.0.0"
    - --port
    - {{ $e.port | quote }}
    - --tp-size
    - {{ .tpSize | quote }}
    - --mem-fraction-static
    - {{ $e.sglang.memFractionStatic | quote }}
    - --enable-metrics
    # Control routes (pause, weight updates, cache flush ...) need the release's engine admin key.
    - --admin-api-key
    - $(MILES_ENGINE_ADMIN_API_KEY)
    {{- if $root.Values.auth.protectEngineGeneration }}
    - --api-key
    - $(MILES_ENGINE_API_KEY)
    {{- end }}
    {{- range (concat $e.sglang.extraArgs .args) }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: HOME
      value: /tmp
    {{- include "miles.job.secretEnv" (dict "root" $root "entries" (list (list "MILES_ENGINE_ADMIN_API_KEY" "engine-admin-api-key") (list "MILES_ENGINE_API_KEY" "engine-api-key"))) | nindent 4 }}
    {{- with $e.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    requests:
      {{- toYaml $e.sglang.resources.requests | nindent 6 }}
      nvidia.com/gpu: {{ .gpus | quote }}
    limits:
      {{- toYaml $e.sglang.resources.limits | nindent 6 }}
      nvidia.com/gpu: {{ .gpus | quote }}
{{- else }}
  image: {{ include "miles.image" (dict "root" $root "image" $e.cpu.image) }}
  imagePullPolicy: {{ $root.Values.global.imagePullPolicy }}
  args:
    - --model-path
    - {{ .modelPath | quote }}
    {{- range (concat $e.cpu.extraArgs .args) }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: MILES_ENGINE_HOST
      value: "0.0.0.0"
    - name: MILES_ENGINE_PORT
      value: {{ $e.port | quote }}
    {{- include "miles.job.secretEnv" (dict "root" $root "entries" (list (list "MILES_ENGINE_ADMIN_API_KEY" "engine-admin-api-key") (list "MILES_ENGINE_API_KEY" "engine-api-key"))) | nindent 4 }}
    {{- if $root.Values.tracing.otlpEndpoint }}
    - name: OTEL_EXPORTER_OTLP_ENDPOINT
      value: {{ $root.Values.tracing.otlpEndpoint | quote }}
    {{- end }}
    {{- with $e.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml $e.cpu.resources | nindent 4 }}
{{- end }}
{{- if not .worker }}
  ports:
    - name: http
      containerPort: {{ $e.port }}
      protocol: TCP
{{- end }}
  securityContext:
    {{- include "miles.containerSecurityContext" $root | nindent 4 }}
{{- if not .worker }}
  startupProbe:
    httpGet: {path: /health, port: http}
    periodSeconds: 10
    failureThreshold: 90
  livenessProbe:
    httpGet: {path: /health, port: http}
    periodSeconds: 15
    timeoutSeconds: 5
    failureThreshold: 4
  readinessProbe:
    httpGet: {path: /health, port: http}
    periodSeconds: 5
    timeoutSeconds: 3
{{- end }}
  volumeMounts:
    {{- .mounts | nindent 4 }}
{{- end -}}

{{- define "miles.job.engineDeployment" -}}
{{- $ctx := dict "root" . "component" "engine" -}}
{{- $sglang := eq .Values.jobTemplates.engine.kind "sglang" -}}
{{- $daemonset := eq .Values.jobTemplates.weightSync.mode "daemonset" -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
  annotations:
    # The engine implementation of these templates (jobTemplates.engine.kind), for the controller to check a job's
    # resources.engines.kind against (job_templates.engine_kind_of).
    miles.dev/engine-kind: {{ .Values.jobTemplates.engine.kind }}
spec:
  replicas: ${ENGINE_REPLICAS}
  revisionHistoryLimit: 3
  selector:
    matchLabels:
      {{- include "miles.job.selectorLabels" $ctx | nindent 6 }}
  # One engine at a time is replaced, never added beside: GPUs are the scarce resource.
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxUnavailable: 1, maxSurge: 0}
  template:
    metadata:
      labels:
        {{- include "miles.job.labels" $ctx | nindent 8 }}
    spec:
      {{- include "miles.job.podCommon" . | nindent 6 }}
      {{- if $daemonset }}
      # daemonset mode: the node's weight-sync daemon loads this engine at http://<node IP>:<port>.
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      {{- $placement := include "miles.nodePlacement" (dict "root" . "pool" (ternary "rollout" "cpu" $sglang)) | fromYaml }}
      {{- if $daemonset }}
      {{- $_ := set $placement "nodeSelector" (merge (dict "miles.dev/job" "${JOB_ID}") ($placement.nodeSelector | default dict)) }}
      {{- end }}
      {{- with $placement }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      topologySpreadConstraints:
        - maxSkew: 1
          topologyKey: kubernetes.io/hostname
          whenUnsatisfiable: ScheduleAnyway
          labelSelector:
            matchLabels:
              {{- include "miles.job.selectorLabels" $ctx | nindent 14 }}
      terminationGracePeriodSeconds: {{ .Values.jobTemplates.engine.terminationGracePeriodSeconds }}
      containers:
        {{- include "miles.job.engineContainer" . | nindent 8 }}
        {{- if not $daemonset }}
        {{- include "miles.job.weightSyncContainer" (dict "root" . "role" "sidecar") | nindent 8 }}
        {{- end }}
      volumes:
        {{- include "miles.job.commonVolumes" (dict "root" . "tmpSize" "20Gi") | nindent 8 }}
        - name: shm
          emptyDir: {medium: Memory, sizeLimit: {{ .Values.jobTemplates.engine.sglang.shmSize }}}
        {{- if not $daemonset }}
        - name: weights
          emptyDir: {sizeLimit: {{ .Values.jobTemplates.weightSync.storageSize }}}
        {{- end }}
{{- end -}}

{{- define "miles.job.engineService" -}}
{{- $ctx := dict "root" . "component" "engine" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
    # The rollout router discovers this pool's engines from the Service's EndpointSlices by this label.
    miles.dev/pool: ${JOB_ID}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "miles.job.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: http, port: {{ .Values.jobTemplates.engine.port }}, targetPort: http, protocol: TCP}
{{- end -}}
