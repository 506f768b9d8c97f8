{{/* The rollout workers of one job: a Deployment (optionally with an HPA) on the rollout-worker node pool. */}}
{{- define "miles.job.rolloutWorkerDeployment" -}}
{{- $ctx := dict "root" . "component" "rollout-worker" -}}
{{- $r := .Values.jobTemplates.rolloutWorker -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  replicas: ${ROLLOUT_WORKER_REPLICAS}
  revisionHistoryLimit: 3
  selector:
    matchLabels:
      {{- include "miles.job.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "miles.job.labels" $ctx | nindent 8 }}
    spec:
      {{- include "miles.job.podCommon" . | nindent 6 }}
      {{- include "miles.nodePlacement" (dict "root" . "pool" $r.nodePool) | nindent 6 }}
      topologySpreadConstraints:
        - maxSkew: 1
          topologyKey: kubernetes.io/hostname
          whenUnsatisfiable: ScheduleAnyway
          labelSelector:
            matchLabels:
              {{- include "miles.job.selectorLabels" $ctx | nindent 14 }}
      containers:
        - name: rollout-worker
          image: {{ include "miles.image" (dict "root" . "image" $r.image) }}
          imagePullPolicy: {{ .Values.global.imagePullPolicy }}
          env:
            {{- include "miles.job.baseEnv" (dict "root" . "prefix" "ROLLOUT" "file" "rollout.json") | nindent 12 }}
            - name: MILES_ROLLOUT_PORT
              value: {{ $r.ports.http | quote }}
            - name: MILES_ROLLOUT_REDIS_URL
              valueFrom:
                secretKeyRef:
                  name: {{ include "miles.secretName" . }}
                  key: redis-url
            - name: MILES_ROLLOUT_SESSION_SERVER_URL
              value: {{ include "miles.job.sharedAddress" (dict "root" . "key" "sessionServer" "kind" "http") | quote }}
            - name: MILES_ROLLOUT_SESSION_OPERATOR_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ include "miles.secretName" . }}
                  key: session-operator-token
            # Read-only: the barrier of train.mode sync waits on the engines' version (GET /v1/weight_version).
            - name: MILES_ROLLOUT_ROUTER_URL
              value: {{ include "miles.job.sharedAddress" (dict "root" . "key" "rolloutRouter" "kind" "http") | quote }}
            - name: MILES_ROLLOUT_BUFFER_ADDRESS
              value: {{ include "miles.job.sharedAddress" (dict "root" . "key" "buffer" "kind" "grpc") | quote }}
            {{- if .Values.sandboxGateway.enabled }}
            - name: MILES_ROLLOUT_SANDBOX_ADDRESS
              value: {{ include "miles.job.sharedAddress" (dict "root" . "key" "sandboxGateway" "kind" "grpc") | quote }}
            # The gateway's HTTP facade (for agents without gRPC) is served on its metrics port.
            - name: MILES_ROLLOUT_SANDBOX_HTTP_URL
              value: {{ include "miles.job.sharedAddress" (dict "root" . "key" "sandboxGateway" "kind" "metrics") | quote }}
            # The job's own capability at the gateway (opens only this job's sandboxes), in the Secret the
            # controller creates for the job.
            - name: MILES_ROLLOUT_SANDBOX_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ include "miles.job.name" (dict "root" . "component" "tokens") }}
                  key: sandbox-token
            {{- end }}
            {{- with $r.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - {name: http, containerPort: {{ $r.ports.http }}, protocol: TCP}
          securityContext:
            {{- include "miles.containerSecurityContext" . | nindent 12 }}
          livenessProbe:
            httpGet: {path: /healthz, port: http}
            periodSeconds: 10
            timeoutSeconds: 3
            failureThreshold: 6
          readinessProbe:
            httpGet: {path: /readyz, port: http}
            periodSeconds: 5
            timeoutSeconds: 3
          resources:
            {{- toYaml $r.resources | nindent 12 }}
          volumeMounts:
            {{- include "miles.job.commonMounts" . | nindent 12 }}
            {{- with $r.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "miles.job.commonVolumes" (dict "root" .) | nindent 8 }}
        {{- with $r.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}

{{- define "miles.job.rolloutWorkerHpa" -}}
{{- $ctx := dict "root" . "component" "rollout-worker" -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "miles.job.name" $ctx }}
  minReplicas: ${ROLLOUT_WORKER_REPLICAS}
  maxReplicas: ${ROLLOUT_WORKER_MAX_REPLICAS}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ .Values.jobTemplates.rolloutWorker.autoscaling.targetCPUUtilizationPercentage }}
{{- end -}}

{{/* The skeleton of the job's spec ConfigMap: the controller fills `data` (see job_templates.py) and owns the rest with it. */}}
{{- define "miles.job.specConfigMap" -}}
{{- $ctx := dict "root" . "component" "job-spec" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "miles.job.name" (dict "root" . "component" "spec") }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
data: {}
{{- end -}}
