{{/*
The engine pool of a job whose engine replica spans nodes (resources.engines.nodes_per_replica > 1): a
LeaderWorkerSet (kubernetes-sigs/lws, leaderworkerset.x-k8s.io/v1; rendered only with leaderWorkerSet.enabled) of
${ENGINE_REPLICAS} groups of ${ENGINE_NODES} pods, one SGLang server per group, its tensor-parallel ranks split over
the group's pods (--nnodes, --node-rank, --dist-init-addr at the leader). The controller creates it instead of the
engine Deployment for such a job (job_templates.ENGINE_LWS_TEMPLATE_KEY).

Only the leader (rank 0) serves HTTP: it carries the engine component label, so the engine Service (and the router
pool miles.dev/pool it labels), the weight-sync sidecar and the per-job policies treat it as the engine; the workers
carry the engine-worker component. RecreateGroupOnPodRestart: a lost pod, or a restarted container, recreates its
whole group, since SGLang's process group cannot take a rank back. LeaderCreated: workers start with the leader,
which is ready only once they have joined it. Weight-sync runs as the leader's sidecar only: in daemonset mode a
daemon would run on every node of the job, worker nodes included, where no engine serves HTTP, so the chart refuses
that combination.
*/}}
{{- define "miles.job.engineLeaderWorkerSet" -}}
{{- $ctx := dict "root" . "component" "engine" -}}
{{- $workerCtx := dict "root" . "component" "engine-worker" -}}
{{- $lws := .Values.leaderWorkerSet -}}
{{- if eq .Values.jobTemplates.weightSync.mode "daemonset" -}}
{{- fail "leaderWorkerSet.enabled needs jobTemplates.weightSync.mode=sidecar: in daemonset mode a weight-sync daemon runs on every node of a job, the multi-node engines' worker nodes included, where no engine serves HTTP" -}}
{{- end -}}
{{- $mounts := include "miles.job.engineMounts" . -}}
{{- $distInit := list "--nnodes" "${ENGINE_NODES}" "--dist-init-addr" (printf "$(LWS_LEADER_ADDRESS):%v" $lws.distInitPort) -}}
{{- $containerArgs := dict "root" . "modelPath" "${MODEL_PATH}" "tpSize" "${TP_SIZE}" "gpus" "${ENGINE_GPUS}" "mounts" $mounts -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
  annotations:
    miles.dev/engine-kind: sglang
spec:
  replicas: ${ENGINE_REPLICAS}
  startupPolicy: LeaderCreated
  rolloutStrategy:
    type: RollingUpdate
    rollingUpdateConfiguration: {maxUnavailable: 1, maxSurge: 0}
  leaderWorkerTemplate:
    size: ${ENGINE_NODES}
    restartPolicy: RecreateGroupOnPodRestart
    leaderTemplate:
      metadata:
        labels:
          {{- include "miles.job.labels" $ctx | nindent 10 }}
      spec:
        {{- include "miles.job.engineGroupPodSpec" . | nindent 8 }}
        containers:
          {{- include "miles.engineContainer" (merge (dict "args" (concat $distInit (list "--node-rank" "0"))) $containerArgs) | nindent 10 }}
          {{- include "miles.job.weightSyncContainer" (dict "root" . "role" "sidecar") | nindent 10 }}
        volumes:
          {{- include "miles.job.engineVolumes" . | nindent 10 }}
    workerTemplate:
      metadata:
        labels:
          {{- include "miles.job.labels" $workerCtx | nindent 10 }}
      spec:
        {{- include "miles.job.engineGroupPodSpec" . | nindent 8 }}
        containers:
          {{- include "miles.engineContainer" (merge (dict "args" (concat $distInit (list "--node-rank" "$(LWS_WORKER_INDEX)")) "worker" true) $containerArgs) | nindent 10 }}
        volumes:
          {{- include "miles.job.engineVolumes" . | nindent 10 }}
{{- end -}}

{{/* Pod-level fields of a multi-node engine group's pods (leader and workers): the engines' node pool. */}}
{{- define "miles.job.engineGroupPodSpec" -}}
{{- include "miles.job.podCommon" . }}
{{- with include "miles.nodePlacement" (dict "root" . "pool" "rollout") }}
{{ . }}
{{- end }}
terminationGracePeriodSeconds: {{ .Values.jobTemplates.engine.terminationGracePeriodSeconds }}
{{- end -}}

{{/* Volumes of a multi-node engine pod (the weights store is the disk transport's, which the engine mounts). */}}
{{- define "miles.job.engineVolumes" -}}
{{- include "miles.job.commonVolumes" (dict "root" . "tmpSize" "20Gi") }}
- name: shm
  emptyDir: {medium: Memory, sizeLimit: {{ .Values.jobTemplates.engine.sglang.shmSize }}}
- name: weights
  emptyDir: {sizeLimit: {{ .Values.jobTemplates.weightSync.storageSize }}}
{{- end -}}
