{{/*
The optional autoscaler of one job's engine pool (jobTemplates.engine.autoscaling): an HPA on the External metric
miles_router_pool_saturation_ratio{pool=<job id>} (requests in flight or queued over the concurrency slots of the
job's engines, summed over router replicas by the metrics adapter; docs/operations.md has the adapter rule). Its
minimum is the job's resources.engines.replicas, which PATCH /v1/jobs/{id} moves; the controller raises maxReplicas
to it when lower, and points the HPA at the engine LeaderWorkerSet for a job whose engine replica spans nodes
(miles.controller.backends.kubernetes_autoscaling). Not used for a job on a shared engine pool.
*/}}
{{- define "miles.job.engineHpa" -}}
{{- $ctx := dict "root" . "component" "engine" -}}
{{- $a := .Values.jobTemplates.engine.autoscaling -}}
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
  minReplicas: ${ENGINE_REPLICAS}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    - type: External
      external:
        metric:
          name: {{ $a.metricName }}
          selector:
            matchLabels:
              pool: ${JOB_ID}
        # Value (not AverageValue): the ratio is already per slot; the HPA wants ceil(replicas * value / target).
        target:
          type: Value
          value: {{ $a.targetValue | quote }}
  behavior:
    scaleUp:
      # The lowest recommendation of the window wins: a weight update's pause (requests held, the ratio high for
      # seconds) does not add engines, a backlog that outlasts the window does.
      stabilizationWindowSeconds: {{ $a.scaleUpStabilizationWindowSeconds }}
      policies:
        # At most double the pool per minute: new engines need minutes (image, model load, weight sync).
        - {type: Percent, value: 100, periodSeconds: 60}
    scaleDown:
      stabilizationWindowSeconds: {{ $a.scaleDownStabilizationWindowSeconds }}
      policies:
        # One engine at a time: each removal cuts the generations still running on it after its grace period.
        - {type: Pods, value: 1, periodSeconds: {{ $a.scaleDownPeriodSeconds }}}
{{- end -}}
