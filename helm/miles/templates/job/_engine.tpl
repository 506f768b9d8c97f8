{{/* The engine pool of one job: SGLang pods (or the CPU reference engine) on the rollout pool. */}}
{{- define "miles.job.engineContainer" -}}
{{- $e := .Values.jobTemplates.engine -}}
{{- if eq $e.kind "sglang" }}
- name: engine
  image: {{ printf "%s:%s" $e.sglang.image.repository $e.sglang.image.tag }}
  imagePullPolicy: {{ .Values.global.imagePullPolicy }}
  command: ["python3", "-m", "sglang.launch_server"]
  args:
    - --model-path
    - "${MODEL_PATH}"
    - --host
    - "0.0.0.0"
    - --port
    - {{ $e.port | quote }}
    - --tp-size
    - "${TP_SIZE}"
    - --mem-fraction-static
    - {{ $e.sglang.memFractionStatic | quote }}
    - --enable-metrics
    {{- range $e.sglang.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: HOME
      value: /tmp
  resources:
    requests:
      {{- toYaml $e.sglang.resources.requests | nindent 6 }}
      nvidia.com/gpu: "${ENGINE_GPUS}"
    limits:
      {{- toYaml $e.sglang.resources.limits | nindent 6 }}
      nvidia.com/gpu: "${ENGINE_GPUS}"
{{- else }}
- name: engine
  image: {{ include "miles.image" (dict "root" . "image" $e.cpu.image) }}
  imagePullPolicy: {{ .Values.global.imagePullPolicy }}
  args: ["--model-path", "${MODEL_PATH}"]
  env:
    - name: MILES_ENGINE_HOST
      value: "0.0.0.0"
    - name: MILES_ENGINE_PORT
      value: {{ $e.port | quote }}
  resources:
    {{- toYaml $e.cpu.resources | nindent 4 }}
{{- end }}
  ports:
    - name: http
      containerPort: {{ $e.port }}
      protocol: TCP
  securityContext:
    {{- include "miles.containerSecurityContext" . | nindent 4 }}
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
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    - {name: shm, mountPath: /dev/shm}
{{- end -}}

{{- define "miles.job.weightSyncContainer" -}}
{{- $w := .Values.jobTemplates.weightSync -}}
- name: weight-sync
  image: {{ include "miles.image" (dict "root" . "image" $w.image) }}
  imagePullPolicy: {{ .Values.global.imagePullPolicy }}
  env:
    {{- include "miles.job.commonEnv" . | nindent 4 }}
    - name: MILES_WEIGHTSYNC_HOST
      value: "0.0.0.0"
    - name: MILES_WEIGHTSYNC_PORT
      value: {{ $w.ports.grpc | quote }}
    - name: MILES_WEIGHTSYNC_METRICS_PORT
      value: {{ $w.ports.metrics | quote }}
    - name: MILES_WEIGHTSYNC_STORE_DIR
      value: /var/lib/miles/weights
    {{- if eq $w.mode "sidecar" }}
    - name: MILES_WEIGHTSYNC_ENGINE_URLS
      value: {{ printf "[\"http://127.0.0.1:%v\"]" .Values.jobTemplates.engine.port | quote }}
    {{- end }}
  ports:
    - {name: grpc, containerPort: {{ $w.ports.grpc }}, protocol: TCP}
    - {name: metrics, containerPort: {{ $w.ports.metrics }}, protocol: TCP}
  securityContext:
    {{- include "miles.containerSecurityContext" . | nindent 4 }}
  livenessProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: 10
  readinessProbe:
    httpGet: {path: /readyz, port: metrics}
    periodSeconds: 5
  resources:
    {{- toYaml $w.resources | nindent 4 }}
  volumeMounts:
    - {name: weights, mountPath: /var/lib/miles/weights}
    - {name: job-spec, mountPath: /etc/miles/job, readOnly: true}
{{- end -}}

{{- define "miles.job.engineDeployment" -}}
{{- $ctx := dict "root" . "component" "engine" -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  replicas: ${ENGINE_REPLICAS}
  selector:
    matchLabels:
      {{- include "miles.job.selectorLabels" $ctx | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxUnavailable: 1, maxSurge: 0}
  template:
    metadata:
      labels:
        {{- include "miles.job.labels" $ctx | nindent 8 }}
    spec:
      automountServiceAccountToken: false
      securityContext:
        {{- include "miles.podSecurityContext" . | nindent 8 }}
      {{- include "miles.nodePlacement" (dict "root" . "pool" (ternary "rollout" "cpu" (eq .Values.jobTemplates.engine.kind "sglang"))) | nindent 6 }}
      terminationGracePeriodSeconds: 60
      containers:
        {{- include "miles.job.engineContainer" . | nindent 8 }}
        {{- if eq .Values.jobTemplates.weightSync.mode "sidecar" }}
        {{- include "miles.job.weightSyncContainer" . | nindent 8 }}
        {{- end }}
      volumes:
        - name: tmp
          emptyDir: {sizeLimit: 20Gi}
        - name: shm
          emptyDir: {medium: Memory, sizeLimit: {{ .Values.jobTemplates.engine.sglang.shmSize }}}
        - name: weights
          emptyDir: {sizeLimit: {{ .Values.jobTemplates.weightSync.storageSize }}}
        {{- include "miles.job.specVolume" . | nindent 8 }}
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

{{- define "miles.job.weightSyncDaemonSet" -}}
{{- $ctx := dict "root" . "component" "weight-sync" -}}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  selector:
    matchLabels:
      {{- include "miles.job.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "miles.job.labels" $ctx | nindent 8 }}
    spec:
      automountServiceAccountToken: false
      securityContext:
        {{- include "miles.podSecurityContext" . | nindent 8 }}
      {{- include "miles.nodePlacement" (dict "root" . "pool" "rollout") | nindent 6 }}
      containers:
        {{- include "miles.job.weightSyncContainer" . | nindent 8 }}
      volumes:
        - name: weights
          emptyDir: {sizeLimit: {{ .Values.jobTemplates.weightSync.storageSize }}}
        {{- include "miles.job.specVolume" . | nindent 8 }}
{{- end -}}
