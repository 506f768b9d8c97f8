{{/*
One inference pool of a job (its spec's inference_pools[]: a judge, a teacher, a reward model): engines of the
pool's own model, never updated (no weight-sync sidecar, no weights volume), and the headless Service whose
EndpointSlices the router discovers as the router pool ${ROUTER_POOL} (<job id>--<pool name>). The controller
instantiates both once per pool (miles.controller.backends.kubernetes_inference_pools) with the job's ${JOB_ID} and
the pool's placeholders: ${POOL_NAME}, ${ROUTER_POOL}, ${POOL_MODEL_PATH}, ${POOL_REPLICAS}, ${POOL_GPUS},
${POOL_TP_SIZE}; it appends the pool's extra_args to the engine container's args and places the pods on the pool's
node_pool when the pool names one.

The pods' component is inference-engine, not engine: the job's engine Service must not select them (the router would
send the policy's requests to the judge), and they take no per-job flows (no weight loads, no update groups); their
NetworkPolicies admit the router (platform-wide flow). The Service is labelled component engine, as a shared pool's
is, because that is the router's k8s_label_selector.
*/}}
{{- define "miles.job.inferencePool.selectorLabels" -}}
{{ include "miles.job.selectorLabels" (dict "root" . "component" "inference-engine") }}
miles.dev/inference-pool: ${POOL_NAME}
{{- end -}}

{{- define "miles.job.inferencePool.labels" -}}
{{ include "miles.job.labels" (dict "root" . "component" "inference-engine") }}
miles.dev/inference-pool: ${POOL_NAME}
{{- end -}}

{{- define "miles.job.inferencePool.name" -}}
{{- printf "%s-${JOB_ID}-pool-${POOL_NAME}" (include "miles.fullname" .) -}}
{{- end -}}

{{- define "miles.job.inferencePoolDeployment" -}}
{{- $sglang := eq .Values.jobTemplates.engine.kind "sglang" -}}
{{- $mounts := printf "%s\n- {name: shm, mountPath: /dev/shm}" (include "miles.job.commonMounts" .) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "miles.job.inferencePool.name" . }}
  labels:
    {{- include "miles.job.inferencePool.labels" . | nindent 4 }}
  annotations:
    miles.dev/engine-kind: {{ .Values.jobTemplates.engine.kind }}
spec:
  replicas: ${POOL_REPLICAS}
  revisionHistoryLimit: 3
  selector:
    matchLabels:
      {{- include "miles.job.inferencePool.selectorLabels" . | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxUnavailable: 1, maxSurge: 0}
  template:
    metadata:
      labels:
        {{- include "miles.job.inferencePool.labels" . | nindent 8 }}
    spec:
      {{- include "miles.job.podCommon" . | nindent 6 }}
      {{- include "miles.nodePlacement" (dict "root" . "pool" (ternary "rollout" "cpu" $sglang)) | nindent 6 }}
      topologySpreadConstraints:
        - maxSkew: 1
          topologyKey: kubernetes.io/hostname
          whenUnsatisfiable: ScheduleAnyway
          labelSelector:
            matchLabels:
              {{- include "miles.job.inferencePool.selectorLabels" . | nindent 14 }}
      terminationGracePeriodSeconds: {{ .Values.jobTemplates.engine.terminationGracePeriodSeconds }}
      containers:
        {{- include "miles.engineContainer" (dict "root" . "modelPath" "${POOL_MODEL_PATH}" "tpSize" "${POOL_TP_SIZE}" "gpus" "${POOL_GPUS}" "args" (list) "mounts" $mounts) | nindent 8 }}
      volumes:
        {{- include "miles.job.commonVolumes" (dict "root" . "tmpSize" "20Gi") | nindent 8 }}
        - name: shm
          emptyDir: {medium: Memory, sizeLimit: {{ .Values.jobTemplates.engine.sglang.shmSize }}}
{{- end -}}

{{- define "miles.job.inferencePoolService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "miles.job.inferencePool.name" . }}
  labels:
    {{- include "miles.job.labels" (dict "root" . "component" "engine") | nindent 4 }}
    # The router's discovery selects this Service's EndpointSlices (component engine) and registers the pool's
    # engines in the router pool named by miles.dev/pool.
    miles.dev/pool: ${ROUTER_POOL}
    miles.dev/inference-pool: ${POOL_NAME}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "miles.job.inferencePool.selectorLabels" . | nindent 4 }}
  ports:
    - {name: http, port: {{ .Values.jobTemplates.engine.port }}, targetPort: http, protocol: TCP}
{{- end -}}
