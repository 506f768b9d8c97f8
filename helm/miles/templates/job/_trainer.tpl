{{/*
The trainer of one job: a StatefulSet (one rank per pod; the pod index is the rank, pod 0 is the rendezvous
master and serves the API) with a headless Service, a PodDisruptionBudget and a checkpoint PVC per rank (or one
shared claim, a directory per job), on the trainer pool.

Failure: a rank whose process ends makes every other rank exit with status 75 within peer_timeout_s (usually at
once; services/trainer rank_health.py), and the kubelet restarts each container in place (restartPolicy Always, so
each pod keeps its index and rank). A restarted rank > 0 that finds the old group's rendezvous store still up waits
for it to go away, so the restarted ranks form a new group and resume from the last checkpoint.
*/}}

{{/*
Probe command: rank 0 answers /healthz and /readyz on its metrics port; ranks > 0 serve no HTTP in this build (they
follow rank 0's collectives), so their probe passes while the container runs and rank 0's covers the job.
*/}}
{{- define "miles.job.trainerProbe" -}}
exec:
  command:
    - python3
    - -c
    - {{ printf "import os,sys,urllib.request; os.environ['MILES_TRAINER_RANK'] == '0' and urllib.request.urlopen('http://127.0.0.1:%v%s', timeout=3)" .port .path | quote }}
{{- end -}}

{{- define "miles.job.trainerStatefulSet" -}}
{{- $ctx := dict "root" . "component" "trainer" -}}
{{- $t := .Values.jobTemplates.trainer -}}
{{- $name := include "miles.job.name" $ctx -}}
{{- $shared := $t.checkpoints.sharedClaimName -}}
{{- if and (eq $t.checkpoints.format "sharded") (not $shared) -}}
{{- fail "jobTemplates.trainer.checkpoints.format=sharded needs jobTemplates.trainer.checkpoints.sharedClaimName: every rank writes its shards into one directory, which a PVC per rank cannot give (use a ReadWriteMany claim, or format full)" -}}
{{- end -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  serviceName: {{ $name }}
  replicas: ${TRAINER_REPLICAS}
  revisionHistoryLimit: 3
  # Ranks start together: rank 0 waits for the others at the rendezvous.
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- include "miles.job.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "miles.job.labels" $ctx | nindent 8 }}
    spec:
      {{- include "miles.job.podCommon" . | nindent 6 }}
      {{- include "miles.nodePlacement" (dict "root" . "pool" "trainer") | nindent 6 }}
      terminationGracePeriodSeconds: {{ $t.terminationGracePeriodSeconds }}
      containers:
        - name: trainer
          image: {{ include "miles.image" (dict "root" . "image" $t.image) }}
          imagePullPolicy: {{ .Values.global.imagePullPolicy }}
          env:
            {{- include "miles.job.baseEnv" (dict "root" . "prefix" "TRAINER" "file" "trainer.json") | nindent 12 }}
            - name: MILES_TRAINER_PORT
              value: {{ $t.ports.grpc | quote }}
            - name: MILES_TRAINER_METRICS_PORT
              value: {{ $t.ports.metrics | quote }}
            - name: MILES_TRAINER_BUFFER_ADDRESS
              value: {{ include "miles.job.sharedAddress" (dict "root" . "key" "buffer" "kind" "grpc") | quote }}
            - name: MILES_TRAINER_MODEL_PATH
              value: "${MODEL_PATH}"
            {{- include "miles.job.secretEnv" (dict "root" . "entries" (list (list "MILES_TRAINER_AUTH_TOKEN" "trainer-auth-token") (list "MILES_TRAINER_WEIGHTSYNC_AUTH_TOKEN" "weightsync-auth-token") (list "MILES_TRAINER_ENGINE_ADMIN_API_KEY" "engine-admin-api-key") (list "MILES_TRAINER_ENGINE_API_KEY" "engine-api-key") (list "MILES_TRAINER_ROUTER_ADMIN_TOKEN" "router-admin-token"))) | nindent 12 }}
            - name: MILES_TRAINER_CHECKPOINT_DIR
              value: /var/lib/miles/checkpoints
            - name: MILES_TRAINER_CHECKPOINT_FORMAT
              value: {{ $t.checkpoints.format | quote }}
            - name: MILES_TRAINER_RANK
              valueFrom:
                fieldRef:
                  fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
            - name: MILES_TRAINER_WORLD_SIZE
              value: "${TRAINER_REPLICAS}"
            - name: MILES_TRAINER_MASTER_ADDR
              value: {{ printf "%s-0.%s" $name $name | quote }}
            - name: MILES_TRAINER_MASTER_PORT
              value: {{ $t.masterPort | quote }}
            # Where each new weight version goes (publish.kind comes from the job spec in trainer.json): the
            # job's weight-sync origin (stream), or the job's engine pool in the router (nccl), whose engines join
            # update groups on rank 0 from weightUpdatePort on.
            - name: MILES_TRAINER_PUBLISH__WEIGHTSYNC_ADDRESS
              value: {{ include "miles.job.originAddress" . | quote }}
            - name: MILES_TRAINER_PUBLISH__ROUTER_URL
              value: {{ include "miles.job.sharedAddress" (dict "root" . "key" "rolloutRouter" "kind" "http") | quote }}
            - name: MILES_TRAINER_PUBLISH__POOL
              value: "${JOB_ID}"
            - name: MILES_TRAINER_PUBLISH__NCCL_MASTER_PORT
              value: {{ $t.weightUpdatePort | quote }}
            {{- with $t.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - {name: grpc, containerPort: {{ $t.ports.grpc }}, protocol: TCP}
            - {name: metrics, containerPort: {{ $t.ports.metrics }}, protocol: TCP}
            - {name: dist, containerPort: {{ $t.masterPort }}, protocol: TCP}
            - {name: weight-update, containerPort: {{ $t.weightUpdatePort }}, protocol: TCP}
          securityContext:
            {{- include "miles.containerSecurityContext" . | nindent 12 }}
          startupProbe:
            {{- include "miles.job.trainerProbe" (dict "port" $t.ports.metrics "path" "/healthz") | nindent 12 }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 90
          livenessProbe:
            {{- include "miles.job.trainerProbe" (dict "port" $t.ports.metrics "path" "/healthz") | nindent 12 }}
            periodSeconds: 15
            timeoutSeconds: 5
            failureThreshold: 4
          readinessProbe:
            {{- include "miles.job.trainerProbe" (dict "port" $t.ports.metrics "path" "/readyz") | nindent 12 }}
            periodSeconds: 10
            timeoutSeconds: 5
          resources:
            requests:
              {{- toYaml $t.resources.requests | nindent 14 }}
              nvidia.com/gpu: "${TRAINER_GPUS}"
            limits:
              {{- toYaml $t.resources.limits | nindent 14 }}
              nvidia.com/gpu: "${TRAINER_GPUS}"
          volumeMounts:
            {{- include "miles.job.commonMounts" . | nindent 12 }}
            {{- if $shared }}
            - {name: checkpoints, mountPath: /var/lib/miles/checkpoints, subPath: "${JOB_ID}"}
            {{- else }}
            - {name: checkpoints, mountPath: /var/lib/miles/checkpoints}
            {{- end }}
            - {name: shm, mountPath: /dev/shm}
      volumes:
        {{- include "miles.job.commonVolumes" (dict "root" . "tmpSize" "20Gi") | nindent 8 }}
        - name: shm
          emptyDir: {medium: Memory, sizeLimit: {{ $t.shmSize }}}
        {{- if $shared }}
        - name: checkpoints
          persistentVolumeClaim: {claimName: {{ $shared | quote }}}
        {{- end }}
  {{- if not $shared }}
  volumeClaimTemplates:
    - metadata:
        name: checkpoints
        labels:
          {{- include "miles.job.labels" $ctx | nindent 10 }}
      spec:
        accessModes: ["ReadWriteOnce"]
        {{- with $t.checkpoints.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $t.checkpoints.size }}
  {{- end }}
{{- end -}}

{{/*
Voluntary disruptions (drains, autoscaler scale-down) of any rank stop the whole job's step and cost the work since
its last checkpoint, so by default none is allowed while the job runs (maxUnavailable 0: a drain of a trainer node
waits until the job ends or the PDB is deleted); involuntary ones are handled by the restart described above.
*/}}
{{- define "miles.job.trainerPdb" -}}
{{- $ctx := dict "root" . "component" "trainer" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ .Values.jobTemplates.trainer.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "miles.job.selectorLabels" $ctx | nindent 6 }}
{{- end -}}

{{/*
Headless: stable DNS per rank (<name>-0.<name> is the rendezvous master, published before it is ready because the
ranks rendezvous before rank 0 serves its probes); the controller's gRPC target.
*/}}
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
    - {name: dist, port: {{ .Values.jobTemplates.trainer.masterPort }}, targetPort: dist, protocol: TCP}
{{- end -}}
