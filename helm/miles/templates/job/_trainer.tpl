{{/* The trainer of one job: a StatefulSet (stable rank identities) with a headless Service and PVCs. */}}
{{- define "miles.job.trainerStatefulSet" -}}
{{- $ctx := dict "root" . "component" "trainer" -}}
{{- $t := .Values.jobTemplates.trainer -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  serviceName: {{ include "miles.job.name" $ctx }}
  replicas: ${TRAINER_REPLICAS}
  podManagementPolicy: Parallel
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
      {{- include "miles.nodePlacement" (dict "root" . "pool" "trainer") | nindent 6 }}
      terminationGracePeriodSeconds: 120
      containers:
        - name: trainer
          image: {{ include "miles.image" (dict "root" . "image" $t.image) }}
          imagePullPolicy: {{ .Values.global.imagePullPolicy }}
          env:
            {{- include "miles.job.commonEnv" . | nindent 12 }}
            - name: MILES_TRAINER_HOST
              value: "0.0.0.0"
            - name: MILES_TRAINER_PORT
              value: {{ $t.ports.grpc | quote }}
            - name: MILES_TRAINER_METRICS_PORT
              value: {{ $t.ports.metrics | quote }}
            - name: MILES_TRAINER_CHECKPOINT_DIR
              value: /var/lib/miles/checkpoints
            - name: MILES_TRAINER_RANK
              valueFrom:
                fieldRef:
                  fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
            - name: MILES_TRAINER_WORLD_SIZE
              value: "${TRAINER_REPLICAS}"
            - name: MILES_TRAINER_MASTER_ADDR
              value: {{ printf "%s-0.%s" (include "miles.job.name" $ctx) (include "miles.job.name" $ctx) | quote }}
            - name: MILES_TRAINER_WEIGHTSYNC_ADDRESS
              value: {{ printf "%s:%v" (include "miles.job.name" (dict "root" . "component" "weight-sync")) .Values.jobTemplates.weightSync.ports.grpc | quote }}
          ports:
            - {name: grpc, containerPort: {{ $t.ports.grpc }}, protocol: TCP}
            - {name: metrics, containerPort: {{ $t.ports.metrics }}, protocol: TCP}
            - {name: dist, containerPort: 29500, protocol: TCP}
          securityContext:
            {{- include "miles.containerSecurityContext" . | nindent 12 }}
          startupProbe:
            httpGet: {path: /healthz, port: metrics}
            periodSeconds: 10
            failureThreshold: 60
          livenessProbe:
            httpGet: {path: /healthz, port: metrics}
            periodSeconds: 15
          readinessProbe:
            httpGet: {path: /readyz, port: metrics}
            periodSeconds: 10
          resources:
            requests:
              {{- toYaml $t.resources.requests | nindent 14 }}
              nvidia.com/gpu: "${TRAINER_GPUS}"
            limits:
              {{- toYaml $t.resources.limits | nindent 14 }}
              nvidia.com/gpu: "${TRAINER_GPUS}"
          volumeMounts:
            - {name: checkpoints, mountPath: /var/lib/miles/checkpoints}
            - {name: tmp, mountPath: /tmp}
            - {name: shm, mountPath: /dev/shm}
            - {name: job-spec, mountPath: /etc/miles/job, readOnly: true}
      volumes:
        - name: tmp
          emptyDir: {sizeLimit: 20Gi}
        - name: shm
          emptyDir: {medium: Memory, sizeLimit: {{ $t.shmSize }}}
        {{- include "miles.job.specVolume" . | nindent 8 }}
  volumeClaimTemplates:
    - metadata:
        name: checkpoints
      spec:
        accessModes: ["ReadWriteOnce"]
        {{- with $t.checkpoints.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $t.checkpoints.size }}
{{- end -}}

{{- define "miles.job.trainerService" -}}
{{- $ctx := dict "root" . "component" "trainer" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "miles.job.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: grpc, port: {{ .Values.jobTemplates.trainer.ports.grpc }}, targetPort: grpc, protocol: TCP}
    - {name: dist, port: 29500, targetPort: dist, protocol: TCP}
{{- end -}}

{{/* In-cluster address of the job's weight-sync (a Service over the sidecars or the DaemonSet pods). */}}
{{- define "miles.job.weightSyncService" -}}
{{- $ctx := dict "root" . "component" "weight-sync" -}}
{{- $selectComponent := ternary "engine" "weight-sync" (eq .Values.jobTemplates.weightSync.mode "sidecar") -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  selector:
    {{- include "miles.job.selectorLabels" (dict "root" . "component" $selectComponent) | nindent 4 }}
  ports:
    - {name: grpc, port: {{ .Values.jobTemplates.weightSync.ports.grpc }}, targetPort: grpc, protocol: TCP, appProtocol: grpc}
{{- end -}}

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
      {{- include "miles.nodePlacement" (dict "root" . "pool" $r.nodePool) | nindent 6 }}
      containers:
        - name: rollout-worker
          image: {{ include "miles.image" (dict "root" . "image" $r.image) }}
          imagePullPolicy: {{ .Values.global.imagePullPolicy }}
          env:
            {{- include "miles.job.commonEnv" . | nindent 12 }}
            - name: MILES_ROLLOUT_HOST
              value: "0.0.0.0"
            - name: MILES_ROLLOUT_PORT
              value: {{ $r.ports.http | quote }}
            - name: MILES_ROLLOUT_REDIS_URL
              valueFrom:
                secretKeyRef:
                  name: {{ include "miles.secretName" . }}
                  key: redis-url
          ports:
            - {name: http, containerPort: {{ $r.ports.http }}, protocol: TCP}
          securityContext:
            {{- include "miles.containerSecurityContext" . | nindent 12 }}
          livenessProbe:
            httpGet: {path: /healthz, port: http}
            periodSeconds: 10
          readinessProbe:
            httpGet: {path: /readyz, port: http}
            periodSeconds: 5
          resources:
            {{- toYaml $r.resources | nindent 12 }}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            - {name: job-spec, mountPath: /etc/miles/job, readOnly: true}
      volumes:
        - name: tmp
          emptyDir: {sizeLimit: 5Gi}
        {{- include "miles.job.specVolume" . | nindent 8 }}
{{- end -}}
