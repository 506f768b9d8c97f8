{{/*
Weight-sync of one job (services/weight-sync/README.md, "Topology"): one origin daemon (a Deployment of one pod
behind <fullname>-${JOB_ID}-weight-sync-origin) that the trainer publishes to, plus daemons next to the engines
(a sidecar per engine pod, or a DaemonSet on the job's dedicated rollout nodes). The origin finds the other
daemons through the headless Service <fullname>-${JOB_ID}-weight-sync-peers (peers_dns) and rolls each version
through them; the others copy missing versions from the origin (origin). Every daemon drains its engines at the
router (router_url, pool = the job's engine pool).
*/}}
{{- define "miles.job.weightSyncContainer" -}}
{{- $root := .root -}}
{{- $w := $root.Values.jobTemplates.weightSync -}}
{{- $enginePort := $root.Values.jobTemplates.engine.port -}}
- name: {{ ternary "weight-sync-origin" "weight-sync" (eq .role "origin") }}
  image: {{ include "miles.image" (dict "root" $root "image" $w.image) }}
  imagePullPolicy: {{ $root.Values.global.imagePullPolicy }}
  env:
    {{- include "miles.job.baseEnv" (dict "root" $root "prefix" "WEIGHTSYNC" "file" "weightsync.json") | nindent 4 }}
    - name: MILES_WEIGHTSYNC_PORT
      value: {{ $w.ports.grpc | quote }}
    - name: MILES_WEIGHTSYNC_METRICS_PORT
      value: {{ $w.ports.metrics | quote }}
    - name: MILES_WEIGHTSYNC_ROUTER_URL
      value: {{ include "miles.job.sharedAddress" (dict "root" $root "key" "rolloutRouter" "kind" "http") | quote }}
    - name: MILES_WEIGHTSYNC_POOL
      value: "${JOB_ID}"
    {{- include "miles.job.secretEnv" (dict "root" $root "entries" (list (list "MILES_WEIGHTSYNC_AUTH_TOKEN" "weightsync-auth-token") (list "MILES_WEIGHTSYNC_ROUTER_ADMIN_TOKEN" "router-admin-token") (list "MILES_WEIGHTSYNC_ENGINE_ADMIN_API_KEY" "engine-admin-api-key") (list "MILES_WEIGHTSYNC_ENGINE_API_KEY" "engine-api-key"))) | nindent 4 }}
    - name: MILES_WEIGHTSYNC_STORE_DIR
      value: /var/lib/miles/weights/store
    - name: MILES_WEIGHTSYNC_WORK_DIR
      value: /var/lib/miles/weights/work
    - name: MILES_WEIGHTSYNC_MODEL_CONFIG_DIR
      value: "${MODEL_PATH}"
    {{- with $w.storeUrl }}
    - name: MILES_WEIGHTSYNC_STORE_URL
      value: {{ . | quote }}
    {{- end }}
    {{- if eq .role "origin" }}
    # A fixed data channel port (the origin's Service and NetworkPolicy declare it) instead of an ephemeral one:
    # receivers connect to the Service they reached gRPC at, on the port the offer names.
    - name: MILES_WEIGHTSYNC_DATA_PORT
      value: {{ $w.ports.data | quote }}
    - name: MILES_WEIGHTSYNC_PEERS_DNS
      value: {{ printf "%s:%v" (include "miles.job.name" (dict "root" $root "component" "weight-sync-peers")) $w.ports.grpc | quote }}
    {{- else }}
    - name: MILES_WEIGHTSYNC_ORIGIN
      value: {{ include "miles.job.originAddress" $root | quote }}
    # The engine's URL as the router knows it (its EndpointSlice address), so that drains name the same engine.
    - name: ENGINE_IP
      valueFrom:
        fieldRef:
          fieldPath: {{ ternary "status.hostIP" "status.podIP" (eq .role "daemon") }}
    - name: MILES_WEIGHTSYNC_ENGINE_URLS
      value: {{ printf "[\"http://$(ENGINE_IP):%v\"]" $enginePort | quote }}
    {{- end }}
  {{- with $w.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    - {name: grpc, containerPort: {{ $w.ports.grpc }}, protocol: TCP}
    - {name: metrics, containerPort: {{ $w.ports.metrics }}, protocol: TCP}
    {{- if eq .role "origin" }}
    - {name: data, containerPort: {{ $w.ports.data }}, protocol: TCP}
    {{- end }}
  securityContext:
    {{- include "miles.containerSecurityContext" $root | nindent 4 }}
  livenessProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: 10
    timeoutSeconds: 3
    failureThreshold: 6
  readinessProbe:
    httpGet: {path: /readyz, port: metrics}
    periodSeconds: 5
    timeoutSeconds: 3
  resources:
    {{- toYaml (ternary $w.origin.resources $w.resources (eq .role "origin")) | nindent 4 }}
  volumeMounts:
    {{- include "miles.job.commonMounts" $root | nindent 4 }}
    - {name: weights, mountPath: /var/lib/miles/weights}
{{- end -}}

{{- define "miles.job.weightSyncOriginDeployment" -}}
{{- $ctx := dict "root" . "component" "weight-sync-origin" -}}
{{- $w := .Values.jobTemplates.weightSync -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  replicas: 1
  revisionHistoryLimit: 3
  # Exactly one origin per job: the old pod is gone before the new one takes publishes.
  strategy:
    type: Recreate
  selector:
    matchLabels:
      {{- include "miles.job.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "miles.job.labels" $ctx | nindent 8 }}
    spec:
      {{- include "miles.job.podCommon" . | nindent 6 }}
      {{- include "miles.nodePlacement" (dict "root" . "pool" $w.origin.nodePool) | nindent 6 }}
      terminationGracePeriodSeconds: 60
      containers:
        {{- include "miles.job.weightSyncContainer" (dict "root" . "role" "origin") | nindent 8 }}
      volumes:
        {{- include "miles.job.commonVolumes" (dict "root" .) | nindent 8 }}
        - name: weights
          emptyDir: {sizeLimit: {{ $w.origin.storageSize }}}
{{- end -}}

{{/* The trainer's publish target and every daemon's origin (gRPC, and the raw TCP data channel of full loads). */}}
{{- define "miles.job.weightSyncOriginService" -}}
{{- $ctx := dict "root" . "component" "weight-sync-origin" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  selector:
    {{- include "miles.job.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: grpc, port: {{ .Values.jobTemplates.weightSync.ports.grpc }}, targetPort: grpc, protocol: TCP, appProtocol: grpc}
    # Same number as the container port: the origin's data channel offers name its listener's port.
    - {name: data, port: {{ .Values.jobTemplates.weightSync.ports.data }}, targetPort: data, protocol: TCP}
{{- end -}}

{{/* Headless Service over the daemons next to the engines, resolved by the origin at every rollout (peers_dns). */}}
{{- define "miles.job.weightSyncPeersService" -}}
{{- $ctx := dict "root" . "component" "weight-sync-peers" -}}
{{- $podComponent := include "miles.podComponent" (dict "root" . "component" "weight-sync") -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "miles.job.selectorLabels" (dict "root" . "component" $podComponent) | nindent 4 }}
  ports:
    - {name: grpc, port: {{ .Values.jobTemplates.weightSync.ports.grpc }}, targetPort: grpc, protocol: TCP, appProtocol: grpc}
{{- end -}}

{{/* daemonset mode: one daemon per node dedicated to this job (label miles.dev/job=<job id>). */}}
{{- define "miles.job.weightSyncDaemonSet" -}}
{{- $ctx := dict "root" . "component" "weight-sync" -}}
{{- $placement := include "miles.nodePlacement" (dict "root" . "pool" "rollout") | fromYaml -}}
{{- $_ := set $placement "nodeSelector" (merge (dict "miles.dev/job" "${JOB_ID}") ($placement.nodeSelector | default dict)) -}}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
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
      {{- toYaml $placement | nindent 6 }}
      containers:
        {{- include "miles.job.weightSyncContainer" (dict "root" . "role" "daemon") | nindent 8 }}
      volumes:
        {{- include "miles.job.commonVolumes" (dict "root" .) | nindent 8 }}
        - name: weights
          emptyDir: {sizeLimit: {{ .Values.jobTemplates.weightSync.storageSize }}}
{{- end -}}
